"""Gold validation: a task is valid only if its hidden tests fail in the unpatched environment and pass once the
gold patch is applied — the same in every one of `runs` runs of each side. Invalid tasks are reported with the
reason and excluded from evaluation.

Each check runs in a fresh fork of the task's environment snapshot (sandboxed when the cache's factory is), with
the same `grade` the harness uses, so a valid task is one the harness can score 0 and 1. A required test whose
result differs between runs of one side is flaky: the task is invalid (its reward would be noise), and the
flaky tests are named. A timeout is reported as one, never as a failing test. A task whose repository's project
has a copy readable through the workspace's interpreter that is newer than the task's commit is invalid
(`rollout/tasks/copies.py`): a set mined with another interpreter is checked against this one's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from rollout.evaluation.gold_cache import GoldCache
from rollout.tasks import copies
from rollout.tasks.environment import EnvironmentBuildError, EnvironmentCache, TestReport, apply_patch, describe, grade
from rollout.tasks.progress import Progress
from rollout.tasks.task import Task

NO_APPLY = "gold patch does not apply"  # to a frozen set's environment: the environment has changed


@dataclasses.dataclass(frozen=True)
class GoldCheck:
  """One task's validation outcome.

  Attributes:
    task_id: the task.
    valid: unpatched fails and gold passes, in every run.
    reason: why invalid ("" when valid).
    post_files: path -> text of the files the gold patch changed, after applying it (for the contamination guard).
    gold_s: the slowest grading of the gold patch (seconds; compare with the task's `tests.timeout_s`).
  """
  task_id: str
  valid: bool
  reason: str = ""
  post_files: dict[str, str] = dataclasses.field(default_factory=dict)
  gold_s: float = 0.0


def _changed_paths(patch: str) -> list[str]:
  out = []
  for line in patch.splitlines():
    if line.startswith("+++ b/"):
      out.append(line[6:].split("\t")[0])
  return out


def _grade_side(task: Task, envs: EnvironmentCache, gold: bool) -> tuple[TestReport | str, dict[str, str]]:
  """One grading in a fresh fork, with or without the gold patch: (report or why it could not run, post files)."""
  ws = envs.fork(task)
  try:
    post = {}
    if gold:
      res = apply_patch(ws, task.gold_patch)
      if not res.ok:
        return (f"{NO_APPLY} (task field gold_patch, to {describe(task.environment)}): "
                f"{res.output.strip()[-300:]}"), {}
      post = {p: ws.read_file(p) for p in _changed_paths(task.gold_patch) if ws.exists(p)}
    return grade(ws, task.tests), post
  finally:
    ws.close()


def _flaky(reports: Sequence[TestReport]) -> list[str]:
  return sorted(t for t in reports[0].results if len({r.results[t] for r in reports}) > 1)


def check_task(task: Task, envs: EnvironmentCache, runs: int = 2,
               readable: copies.ReadableCopies | None = None) -> GoldCheck:
  """Validates one task (see the module docstring); `readable`: the copies of its repository's project that the
  workspace's interpreter can read (a task older than one is invalid: its future is readable)."""
  if not task.gold_patch.strip():
    return GoldCheck(task.id, False, "no gold patch")
  try:
    envs.snapshot(task.environment)
  except EnvironmentBuildError as e:
    return GoldCheck(task.id, False, f"environment does not build: {e}")
  why = readable.refusal(task.environment.commit) if readable else ""
  if why:
    return GoldCheck(task.id, False, why)
  sides = {}
  post: dict[str, str] = {}
  for side, gold in (("unpatched", False), ("gold", True)):
    reports = []
    for _ in range(runs):
      rep, post_files = _grade_side(task, envs, gold)
      if isinstance(rep, str):
        return GoldCheck(task.id, False, rep)
      if rep.timed_out:
        return GoldCheck(task.id, False, f"{side} grading timed out ({rep.error})")
      if rep.error:
        return GoldCheck(task.id, False, f"{side} grading failed: {rep.error}")
      reports.append(rep)
      post = post_files or post
    flaky = _flaky(reports)
    if flaky:
      return GoldCheck(task.id, False, f"flaky tests ({side} results differ between {runs} runs): {flaky[:5]}")
    sides[side] = reports
    if not gold and reports[0].passed:
      return GoldCheck(task.id, False, "hidden tests already pass without the gold patch")
  after = sides["gold"][0]
  if not after.passed:
    bad = sorted(t for t, s in after.results.items() if s != "PASSED")
    return GoldCheck(task.id, False, f"gold patch fails hidden tests {bad[:5]}")
  return GoldCheck(task.id, True, "", post, max(r.wall_s for r in sides["gold"]))


def _readable(task: Task, envs: EnvironmentCache, found: dict[str, copies.ReadableCopies]):
  """The readable copies of the task's repository's project (None for a task without a repository, or one that is
  not there: its environment does not build, which `check_task` reports)."""
  repo = task.environment.repo
  if not repo or not os.path.isdir(repo):
    return None
  if repo not in found:
    try:
      found[repo] = copies.find(repo, envs)
    except EnvironmentBuildError:  # not a git repository: the environment build says so
      return None
  return found[repo]


def validate(tasks: Sequence[Task], envs: EnvironmentCache, runs: int = 2, progress: bool = True,
             cache: GoldCache | None = None) -> tuple[list[Task], list[GoldCheck]]:
  """Returns (valid tasks in order, every task's check); a progress bar counts valid tasks and invalid reasons.
  With a `cache`, a task whose task, environment and grader are unchanged since a stored check is not graded
  again (`gold_cache.py`)."""
  if runs < 2:
    raise ValueError(f"gold validation runs each side at least twice (to find flaky tests), got runs={runs}")
  checks = []
  readable: dict[str, copies.ReadableCopies] = {}  # repository -> its project's readable copies, found once
  with Progress("gold validation", len(tasks), progress) as bar:
    for t in tasks:
      key = cache.key(t, envs, runs) if cache else None
      stored = cache.get(key) if cache else None
      c = GoldCheck(**stored) if stored else check_task(t, envs, runs, _readable(t, envs, readable))
      if cache and not stored:
        cache.put(key, c)
      checks.append(c)
      if c.valid:
        bar.kept()
      else:
        bar.rejected(c.reason)
  return [t for t, c in zip(tasks, checks, strict=True) if c.valid], checks
