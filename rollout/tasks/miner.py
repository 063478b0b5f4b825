"""Mines tasks from a local git repository's history: commits that change code and tests together.

For each non-merge commit C with parent P:
  1. split its changes into test files (`test_pattern`) and code files (`code_suffixes`); both must change;
  2. prompt = the commit subject (terse, like a real request); gold patch = the code diff; hidden tests = the test diff;
  3. validate in sandboxed workspaces forked from the repository at P: run the changed test files with the test patch
     applied, without and with the gold patch. fail_to_pass = tests that fail (or cannot even be collected) before
     and pass after; pass_to_pass = tests that pass in both. A commit with no fail_to_pass test is rejected.
Every rejected commit is reported with its reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess

from rollout.tasks.environment import EnvironmentCache, apply_patch, parse_results
from rollout.tasks.progress import Progress
from rollout.tasks.task import Environment, HiddenTests, Task


@dataclasses.dataclass(frozen=True)
class MinerConfig:
  """What counts as a test / code change and how tests run.

  Attributes:
    test_pattern: regex on repository paths marking test files.
    code_suffixes: suffixes of code files (other files, e.g. docs, are ignored).
    test_command: shell command; `{files}` is replaced by the changed test files. Must print pytest `-rA` style
      "PASSED <id>" / "FAILED <id>" lines.
    max_commits: newest commits examined.
    timeout_s: limit for one test run.
    setup: environment setup commands (e.g. offline installs), run once per base commit.
    prompt_max_chars: commit subjects are cut to this length.
    progress: show a progress bar (stderr) with counts and rejection reasons.
  """
  test_pattern: str = r"(^|/)(tests?/.*\.py|test_[^/]*\.py|[^/]*_test\.py)$"
  code_suffixes: tuple[str, ...] = (".py",)
  test_command: str = "python -m pytest -rA -q -p no:cacheprovider {files}"
  max_commits: int = 200
  timeout_s: float = 120.0
  setup: tuple[str, ...] = ()
  prompt_max_chars: int = 200
  progress: bool = True


@dataclasses.dataclass(frozen=True)
class Rejection:
  """A commit that did not become a task, and why."""
  commit: str
  reason: str


def _git(repo: str, *args: str) -> str:
  out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
  if out.returncode != 0:
    raise ValueError(f"git {' '.join(args)} failed in {repo!r}: {out.stderr.strip()[:300]}")
  return out.stdout


def _candidates(repo: str, cfg: MinerConfig) -> list[tuple[str, str, str]]:
  """(commit, parent, subject) of non-merge commits with a parent, newest first."""
  log = _git(repo, "log", "--no-merges", f"-n{cfg.max_commits}", "--format=%H %P%x00%s")
  out = []
  for line in log.splitlines():
    head, subject = line.split("\x00", 1)
    shas = head.split()
    out.append((shas[0], shas[1] if len(shas) > 1 else "", subject.strip()))
  return out


def _run_tests(envs: EnvironmentCache, env: Environment, patches: list[str], command: str,
               timeout_s: float) -> tuple[dict[str, str] | None, str]:
  """Test results in a fresh fork with `patches` applied, or (None, reason)."""
  ws = envs.factory.fork(envs.snapshot(env))
  try:
    for patch in patches:
      res = apply_patch(ws, patch)
      if not res.ok:
        return None, f"patch does not apply: {res.output.strip()[-200:]}"
    res = ws.run(command, timeout_s=timeout_s)
    if res.timed_out:
      return None, f"tests timed out after {timeout_s:g}s"
    return parse_results(res.output), ""
  finally:
    ws.close()


def mine_commit(repo: str, commit: str, parent: str, subject: str, envs: EnvironmentCache,
                cfg: MinerConfig = MinerConfig()) -> Task | Rejection:
  """One candidate commit -> a validated Task, or a Rejection with the reason."""
  if not parent:
    return Rejection(commit, "root commit (no parent to start from)")
  if not subject:
    return Rejection(commit, "empty commit message (no prompt)")
  status = [line.split("\t") for line in _git(repo, "diff", "--name-status", parent, commit).splitlines()]
  test_re = re.compile(cfg.test_pattern)
  tests = [(s[0], s[-1]) for s in status if test_re.search(s[-1])]
  code = [s[-1] for s in status if not test_re.search(s[-1]) and s[-1].endswith(cfg.code_suffixes)]
  if not code:
    return Rejection(commit, "no code file changed")
  if not tests:
    return Rejection(commit, "no test file changed")
  test_files = [p for s, p in tests if not s.startswith("D")]
  if not test_files:
    return Rejection(commit, "the commit only deletes tests")
  gold = _git(repo, "diff", "--no-renames", parent, commit, "--", *code)
  test_patch = _git(repo, "diff", "--no-renames", parent, commit, "--", *[p for _, p in tests])
  env = Environment(repo=repo, commit=parent, setup=cfg.setup)
  command = cfg.test_command.format(files=" ".join(shlex.quote(p) for p in test_files))
  before, why = _run_tests(envs, env, [test_patch], command, cfg.timeout_s)
  if before is None:
    return Rejection(commit, f"before the fix: {why}")
  after, why = _run_tests(envs, env, [test_patch, gold], command, cfg.timeout_s)
  if after is None:
    return Rejection(commit, f"with the gold patch: {why}")
  f2p = tuple(t for t, s in after.items() if s == "PASSED" and before.get(t) != "PASSED")
  p2p = tuple(t for t, s in after.items() if s == "PASSED" and before.get(t) == "PASSED")
  if not f2p:
    return Rejection(commit, "no test goes from failing to passing")
  numstat = _git(repo, "diff", "--numstat", parent, commit, "--", *code)
  changed_lines = sum(int(a) + int(d) for a, d, _ in (ln.split("\t") for ln in numstat.splitlines()) if a != "-")
  prompt = subject if len(subject) <= cfg.prompt_max_chars else subject[:cfg.prompt_max_chars - 3] + "..."
  name = re.sub(r"[^\w.-]", "_", repo.rstrip("/").split("/")[-1])
  return Task(id=f"miner/{name}/{commit[:12]}", language="python", prompt=prompt, environment=env,
              tests=HiddenTests(command=command, fail_to_pass=f2p, pass_to_pass=p2p, patch=test_patch,
                                timeout_s=cfg.timeout_s),
              gold_patch=gold,
              metadata={"source": "miner", "commit": commit, "parent": parent, "changed_files": code,
                        "changed_lines": changed_lines, "failed_after": sorted(t for t, s in after.items()
                                                                               if s != "PASSED")})


def mine(repo: str, envs: EnvironmentCache, cfg: MinerConfig = MinerConfig(),
         log=print) -> tuple[list[Task], list[Rejection]]:
  """Mines every candidate commit of `repo` (newest first).

  Args:
    repo: path of a local git repository.
    envs: environment cache (its factory makes the validation sandboxes).
    cfg: miner settings.
    log: progress lines.

  Returns:
    (valid tasks, rejections with reasons).
  """
  tasks, rejected = [], []
  candidates = _candidates(repo, cfg)
  with Progress(f"mine {os.path.basename(repo.rstrip('/'))}", len(candidates), cfg.progress) as bar:
    for commit, parent, subject in candidates:
      out = mine_commit(repo, commit, parent, subject, envs, cfg)
      if isinstance(out, Task):
        tasks.append(out)
        bar.kept()
      else:
        rejected.append(out)
        bar.rejected(out.reason)
  log(f"[mine] {repo}: {bar.summary()}")
  return tasks, rejected
