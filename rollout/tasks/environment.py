"""Builds task environments into workspace snapshots (cached by environment), and grades workspaces.

Grading cost is one shell command in the workspace (plus writing the hidden files / applying the hidden patch):
the procedural family's plain `python3 hidden_test.py` scripts avoid pytest's start-up time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import tempfile

from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import CommandResult, Workspace, WorkspaceFactory

RESULT_LINE = re.compile(r"^(PASSED|FAILED|ERROR)\s+(\S+)", re.MULTILINE)


class EnvironmentBuildError(RuntimeError):
  """An environment could not be built (missing repo/commit, a failing setup command)."""


def _git(repo: str, *args: str) -> str:
  out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
  if out.returncode != 0:
    raise EnvironmentBuildError(f"git {' '.join(args)} in {repo!r} failed: {out.stderr.strip()[:300]}")
  return out.stdout


def materialize(env: Environment, dest: str) -> None:
  """Writes the environment's files (before setup) into the empty directory `dest`."""
  if env.base_dir:
    if not os.path.isdir(env.base_dir):
      raise EnvironmentBuildError(f"environment base_dir {env.base_dir!r} does not exist")
    shutil.copytree(env.base_dir, dest, symlinks=True, dirs_exist_ok=True)
  elif env.repo:
    if not os.path.isdir(env.repo):
      raise EnvironmentBuildError(f"environment repo {env.repo!r} does not exist")
    subprocess.run(["git", "clone", "-q", "--no-checkout", env.repo, dest], check=True, capture_output=True)
    _git(dest, "-c", "advice.detachedHead=false", "checkout", "-q", env.commit)
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

  def fork(self, task: Task) -> Workspace:
    return self.factory.fork(self.snapshot(task.environment))


@dataclasses.dataclass(frozen=True)
class TestReport:
  """Hidden-test outcome.

  Attributes:
    passed: every required test (fail_to_pass + pass_to_pass) was reported PASSED.
    pass_fraction: fraction of required tests that passed (a logged metric).
    results: test id -> "PASSED" | "FAILED" | "ERROR" | "MISSING" for the required tests.
    wall_s: time to grade (hidden files + command).
    error: why grading could not run (patch did not apply, timeout), or "".
  """
  passed: bool
  pass_fraction: float
  results: dict[str, str]
  wall_s: float
  error: str = ""


def parse_results(output: str) -> dict[str, str]:
  """Test id -> status from "PASSED id" / "FAILED id" / "ERROR id" lines (the last line for an id wins)."""
  return {m.group(2): m.group(1) for m in RESULT_LINE.finditer(output)}


def _restore_and_apply(ws: Workspace, patch: str, timeout_s: float) -> CommandResult | None:
  """Applies the hidden patch; files it touches are first reset to the commit (agent edits to tests are dropped)."""
  paths = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch, re.MULTILINE)) |
                 set(re.findall(r"^--- a/(\S+)", patch, re.MULTILINE)))
  ws.write_file(".hidden_tests.patch", patch)
  quoted = " ".join(shlex.quote(p) for p in paths)
  cmd = (f"(git checkout -q HEAD -- {quoted} 2>/dev/null || true) && "
         "git apply --whitespace=nowarn .hidden_tests.patch; s=$?; rm -f .hidden_tests.patch; exit $s")
  res = ws.run(cmd, timeout_s=timeout_s)
  return None if res.ok else res


def grade(ws: Workspace, tests: HiddenTests) -> TestReport:
  """Writes/applies the hidden tests into `ws`, runs them and checks every required id passed."""
  required = list(tests.fail_to_pass) + list(tests.pass_to_pass)
  wall = 0.0
  if tests.patch:
    failed = _restore_and_apply(ws, tests.patch, tests.timeout_s)
    if failed is not None:
      return TestReport(False, 0.0, dict.fromkeys(required, "MISSING"), failed.wall_s,
                        f"hidden test patch did not apply: {failed.output[-300:]}")
  for path, text in tests.files.items():
    ws.write_file(path, text)
  res = ws.run(tests.command, timeout_s=tests.timeout_s)
  wall += res.wall_s
  found = parse_results(res.output)
  results = {t: found.get(t, "MISSING") for t in required}
  n_pass = sum(v == "PASSED" for v in results.values())
  error = "hidden tests timed out" if res.timed_out else ""
  return TestReport(n_pass == len(required), n_pass / len(required), results, wall, error)


def apply_patch(ws: Workspace, patch: str, timeout_s: float = 60.0) -> CommandResult:
  """Applies a unified diff in the workspace root (git apply, falling back to patch -p1 outside git trees)."""
  ws.write_file(".gold.patch", patch)
  return ws.run("(git apply --whitespace=nowarn .gold.patch 2>/dev/null || patch -s -p1 -f < .gold.patch);"
                " s=$?; rm -f .gold.patch; exit $s", timeout_s=timeout_s)
