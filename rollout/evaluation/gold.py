"""Gold validation: a task is valid only if its hidden tests fail in the unpatched environment and pass once the
gold patch is applied. Invalid tasks are reported with the reason and excluded from evaluation.

Each check runs in a fresh fork of the task's environment snapshot (sandboxed when the cache's factory is), with
the same `grade` the harness uses, so a valid task is one the harness can score 0 and 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rollout.tasks.environment import EnvironmentBuildError, EnvironmentCache, apply_patch, grade
from rollout.tasks.task import Task


@dataclasses.dataclass(frozen=True)
class GoldCheck:
  """One task's validation outcome.

  Attributes:
    task_id: the task.
    valid: unpatched fails and gold passes.
    reason: why invalid ("" when valid).
    post_files: path -> text of the files the gold patch changed, after applying it (for the contamination guard).
  """
  task_id: str
  valid: bool
  reason: str = ""
  post_files: dict[str, str] = dataclasses.field(default_factory=dict)


def _changed_paths(patch: str) -> list[str]:
  out = []
  for line in patch.splitlines():
    if line.startswith("+++ b/"):
      out.append(line[6:].split("\t")[0])
  return out


def check_task(task: Task, envs: EnvironmentCache) -> GoldCheck:
  """Validates one task (see the module docstring)."""
  if not task.gold_patch.strip():
    return GoldCheck(task.id, False, "no gold patch")
  try:
    ws = envs.fork(task)
  except EnvironmentBuildError as e:
    return GoldCheck(task.id, False, f"environment does not build: {e}")
  try:
    before = grade(ws, task.tests)
  finally:
    ws.close()
  if before.error:
    return GoldCheck(task.id, False, f"unpatched grading failed: {before.error}")
  if before.passed:
    return GoldCheck(task.id, False, "hidden tests already pass without the gold patch")
  ws = envs.fork(task)
  try:
    res = apply_patch(ws, task.gold_patch)
    if not res.ok:
      return GoldCheck(task.id, False, f"gold patch does not apply: {res.output.strip()[-200:]}")
    post = {p: ws.read_file(p) for p in _changed_paths(task.gold_patch) if ws.exists(p)}
    after = grade(ws, task.tests)
  finally:
    ws.close()
  if not after.passed:
    bad = sorted(t for t, s in after.results.items() if s != "PASSED")
    return GoldCheck(task.id, False, f"gold patch fails hidden tests {bad[:5]}" +
                     (f" ({after.error})" if after.error else ""))
  return GoldCheck(task.id, True, "", post)


def validate(tasks: Sequence[Task], envs: EnvironmentCache) -> tuple[list[Task], list[GoldCheck]]:
  """Returns (valid tasks in order, every task's check)."""
  checks = [check_task(t, envs) for t in tasks]
  return [t for t, c in zip(tasks, checks, strict=True) if c.valid], checks
