"""Builds task environments into workspace snapshots (cached by environment), and grades workspaces.

A git environment holds only the history up to its commit: a fresh repository into which that commit and its
ancestors are fetched, on one branch, with no remote, other refs, reflog or objects of later commits (a task's
workspace must not contain its own solution, or the future of the repository).

Grading reads a machine-readable report (`grade_report.py`), never the command's console output. Its cost is one
shell command in the workspace (plus writing the hidden files / applying the hidden patch): the procedural family's
plain `python3 hidden_test.py` scripts avoid pytest's start-up time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shlex
import shutil
import subprocess
import tempfile

from rollout.tasks import grade_report
from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import CommandResult, Workspace, WorkspaceFactory

TIMEOUT_ERROR = "hidden tests timed out"  # TestReport.error of a timed-out grading (reported apart from failures)
BRANCH = "main"  # the one branch of a task's repository


class EnvironmentBuildError(RuntimeError):
  """An environment could not be built (missing repo/commit, a failing setup command)."""


def git(repo: str, *args: str, error=EnvironmentBuildError) -> str:
  """`git -C repo args` -> stdout; a failure raises `error` with git's own message."""
  out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
  if out.returncode != 0:
    raise error(f"git {' '.join(args)} in {repo!r} failed: {out.stderr.strip()[:500]}")
  return out.stdout


def fetch_history(repo: str, commit: str, dest: str) -> str:
  """Makes `dest` a new repository holding `commit` and its ancestors only (see the module docstring); returns the
  full sha. Fetching one sha needs the source's upload-pack to allow any wanted sha (set for this call only)."""
  found = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                         capture_output=True, text=True)
  if found.returncode != 0:
    raise EnvironmentBuildError(f"commit {commit!r} is not in the repository {repo!r}")
  sha = found.stdout.strip()
  git(os.path.dirname(dest) or ".", "init", "-q", "-b", BRANCH, os.path.basename(dest))
  git(dest, "fetch", "-q", "--no-tags", "--upload-pack", "git -c uploadpack.allowAnySHA1InWant=true upload-pack",
      os.path.abspath(repo), sha)
  git(dest, "-c", "advice.detachedHead=false", "checkout", "-q", "-B", BRANCH, sha)
  os.remove(os.path.join(dest, ".git", "FETCH_HEAD"))
  git(dest, "reflog", "expire", "--expire=now", "--all")
  return sha


def materialize(env: Environment, dest: str) -> None:
  """Writes the environment's files (before setup) into the empty directory `dest`."""
  if env.base_dir:
    if not os.path.isdir(env.base_dir):
      raise EnvironmentBuildError(f"environment base_dir {env.base_dir!r} does not exist")
    shutil.copytree(env.base_dir, dest, symlinks=True, dirs_exist_ok=True)
  elif env.repo:
    if not os.path.isdir(env.repo):
      raise EnvironmentBuildError(f"environment repo {env.repo!r} does not exist")
    fetch_history(env.repo, env.commit, dest)
  else:
    os.makedirs(dest, exist_ok=True)
  for path, text in env.files.items():
    p = os.path.join(dest, path)
    os.makedirs(os.path.dirname(p) or dest, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
      f.write(text)


class EnvironmentCache:
  """Environment -> snapshot, built once (materialize, run setup in a workspace, freeze)."""

  def __init__(self, factory: WorkspaceFactory, setup_timeout_s: float = 600.0):
    self.factory = factory
    self.setup_timeout_s = setup_timeout_s
    self._snapshots: dict[str, object] = {}

  def snapshot(self, env: Environment):
    key = env.key()
    if key not in self._snapshots:
      with tempfile.TemporaryDirectory(prefix="env_") as tmp:
        materialize(env, os.path.join(tmp, "root"))
        snap = self.factory.snapshot_from_dir(os.path.join(tmp, "root"))
      if env.setup:
        ws = self.factory.fork(snap)
        try:
          for cmd in env.setup:
            res = ws.run(cmd, timeout_s=self.setup_timeout_s)
            if not res.ok:
              raise EnvironmentBuildError(f"setup command {cmd!r} failed (exit {res.exit_code}): {res.output[-500:]}")
          snap = self.factory.snapshot(ws)
        finally:
          ws.close()
      self._snapshots[key] = snap
    return self._snapshots[key]

  def put(self, env: Environment, snapshot) -> None:
    """Registers an already-built snapshot for `env` (e.g. one an auto-install run validated)."""
    self._snapshots[env.key()] = snapshot

  def fork(self, task: Task) -> Workspace:
    return self.factory.fork(self.snapshot(task.environment))


@dataclasses.dataclass(frozen=True)
class TestRun:
  """One run of a test command: test id -> status for every test the report names, and how the run went."""
  results: dict[str, str]
  timed_out: bool
  wall_s: float
  output: str  # the (capped) console output, for people reading logs; never parsed
  reported: bool = True  # the command wrote a report (False: the plugin never loaded, or the runner never ran)

  def no_report_reason(self) -> str:
    return ("the test command wrote no report (a pytest command must run as `python -m pytest` in the workspace "
            f"root, so that the grading plugin can load): ...{self.output.strip()[-300:]}")


def run_tests(ws: Workspace, command: str, report: str, timeout_s: float, clean: bool = True) -> TestRun:
  """Runs `command` in `ws` with a fresh report file and nonce (see `grade_report`) and reads the report; `clean`:
  then removes the report and the plugin (one more sandboxed command; not needed when `ws` is closed next)."""
  if report not in grade_report.REPORT_KINDS:
    raise ValueError(f"unknown test report kind {report!r}; valid: {grade_report.REPORT_KINDS}")
  nonce, token = secrets.token_hex(8), secrets.token_hex(8)  # names the code under test cannot have prepared
  tmp, plugin = f".grade_{token}", f"{grade_report.PLUGIN_MODULE}_{token}"
  env = f'GRADE_NONCE={nonce} GRADE_REPORT="$PWD/{tmp}/report.jsonl"'
  ws.write_file(f"{tmp}/.dir", "")  # creates the directory without a process (file writes are host operations)
  if report == "pytest":
    # In the workspace root, which `python -m` puts on sys.path: PYTHONPATH would be overridden by a command that
    # sets its own (`PYTHONPATH=src python -m pytest ...`).
    ws.write_file(f"{plugin}.py", grade_report.PYTEST_PLUGIN)
    env += f' PYTEST_ADDOPTS="-p {plugin} {grade_report.PYTEST_ADDOPTS} ${{PYTEST_ADDOPTS:-}}"'
  res = ws.run(f"{env} {command}", timeout_s=timeout_s)
  reported = ws.exists(f"{tmp}/report.jsonl")
  text = ws.read_file(f"{tmp}/report.jsonl") if reported else ""
  if clean:
    ws.run(f"rm -rf {tmp} {plugin}.py", timeout_s=30)
  return TestRun(grade_report.parse_report(text, nonce), res.timed_out, res.wall_s, res.output,
                 reported or res.timed_out)


@dataclasses.dataclass(frozen=True)
class TestReport:
  """Hidden-test outcome.

  Attributes:
    passed: every required test (fail_to_pass + pass_to_pass) was reported PASSED.
    pass_fraction: fraction of required tests that passed (a logged metric).
    results: test id -> "PASSED" | "FAILED" | "ERROR" | "SKIPPED" | "MISSING" for the required tests.
    wall_s: time to grade (hidden files + command).
    error: why grading could not run (patch did not apply) or was cut short (`TIMEOUT_ERROR`), or "".
  """
  passed: bool
  pass_fraction: float
  results: dict[str, str]
  wall_s: float
  error: str = ""

  @property
  def timed_out(self) -> bool:
    return self.error.startswith(TIMEOUT_ERROR)


def _restore_and_apply(ws: Workspace, patch: str, timeout_s: float) -> CommandResult | None:
  """Applies the hidden patch; files it touches are first reset to the commit (agent edits to tests are dropped)."""
  paths = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch, re.MULTILINE)) |
                 set(re.findall(r"^--- a/(\S+)", patch, re.MULTILINE)))
  ws.write_file(".hidden_tests.patch", patch)
  quoted = " ".join(shlex.quote(p) for p in paths)
  # Reset each touched file to the commit, or remove it if the commit lacks it (the patch creates it).
  cmd = ("if git rev-parse --git-dir >/dev/null 2>&1; then "
         f"for p in {quoted}; do git checkout -q HEAD -- \"$p\" 2>/dev/null || rm -f \"$p\"; done; fi; "
         "git apply --whitespace=nowarn .hidden_tests.patch; s=$?; rm -f .hidden_tests.patch; exit $s")
  res = ws.run(cmd, timeout_s=timeout_s)
  return None if res.ok else res


def grade(ws: Workspace, tests: HiddenTests, clean: bool = True) -> TestReport:
  """Writes/applies the hidden tests into `ws`, runs them and checks every required id passed; `clean=False` leaves
  the test run's report files behind (`run_tests`: for a workspace closed next)."""
  required = list(tests.fail_to_pass) + list(tests.pass_to_pass)
  if tests.patch:
    failed = _restore_and_apply(ws, tests.patch, tests.timeout_s)
    if failed is not None:
      return TestReport(False, 0.0, dict.fromkeys(required, "MISSING"), failed.wall_s,
                        f"hidden test patch did not apply: {failed.output[-300:]}")
  for path, text in tests.files.items():
    ws.write_file(path, text)
  run = run_tests(ws, tests.command, tests.report, tests.timeout_s, clean)
  results = {t: run.results.get(t, "MISSING") for t in required}
  n_pass = sum(v == "PASSED" for v in results.values())
  error = f"{TIMEOUT_ERROR} after {tests.timeout_s:g} s" if run.timed_out else \
    "" if run.reported else run.no_report_reason()
  return TestReport(n_pass == len(required), n_pass / len(required), results, run.wall_s, error)


def apply_patch(ws: Workspace, patch: str, timeout_s: float = 60.0) -> CommandResult:
  """Applies a unified diff in the workspace root: `git apply`, else `patch -p1` (which tolerates fuzz) if a dry run
  of it applies every hunk. When neither applies, nothing is changed and the output is git's, which names the file
  and line that do not match."""
  ws.write_file(".gold.patch", patch)
  return ws.run("if git apply --whitespace=nowarn .gold.patch 2>.gold.err; then s=0; "
                "elif patch -s -p1 -f --dry-run < .gold.patch >/dev/null 2>&1; then "
                "patch -s -p1 -f < .gold.patch; s=$?; "
                "else cat .gold.err; s=1; fi; rm -f .gold.patch .gold.err; exit $s", timeout_s=timeout_s)


def describe(env: Environment) -> str:
  """Where an environment's files come from, for error messages."""
  if env.repo:
    return f"the repository {env.repo} at {env.commit}"
  if env.base_dir:
    return f"the directory {env.base_dir}"
  return f"{len(env.files)} inline files"
