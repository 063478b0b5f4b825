"""A task set's own statistics, as the Composer 2 report characterises benchmarks: prompt length in characters and
gold-diff size in changed lines and files (median and quartiles), side by side for several sets."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from rollout.tasks.task import Task

_FILE_RE = re.compile(r"^\+\+\+ b/(\S+)|^--- a/(\S+)", re.MULTILINE)


def diff_size(patch: str) -> tuple[int, int]:
  """(changed lines, changed files) of a unified diff: +/- lines outside headers, distinct paths in ---/+++ headers."""
  lines = sum(1 for ln in patch.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---")))
  files = {a or b for a, b in _FILE_RE.findall(patch)}
  return lines, len(files)


def quartiles(values: Sequence[float]) -> dict[str, float]:
  """q25 / median / q75 (numpy's linear interpolation)."""
  v = np.asarray(values, np.float64)
  if v.size == 0:
    return {"q25": float("nan"), "median": float("nan"), "q75": float("nan")}
  q25, med, q75 = np.percentile(v, [25, 50, 75])
  return {"q25": float(q25), "median": float(med), "q75": float(q75)}


def set_statistics(tasks: Sequence[Task]) -> dict[str, dict[str, float] | int]:
  """n_tasks and quartiles of prompt_chars, diff_lines and diff_files (from each task's gold patch)."""
  sizes = [diff_size(t.gold_patch) for t in tasks]
  return {"n_tasks": len(tasks), "prompt_chars": quartiles([len(t.prompt) for t in tasks]),
          "diff_lines": quartiles([s[0] for s in sizes]), "diff_files": quartiles([s[1] for s in sizes])}


def compare_table(sets: Mapping[str, Sequence[Task]]) -> str:
  """A plain-text table with one row per set: n, and median [q25-q75] of each statistic."""
  header = f"{'set':<24} {'n':>5}  {'prompt chars':>22}  {'diff lines':>18}  {'diff files':>16}"
  rows = [header, "-" * len(header)]
  for name, tasks in sets.items():
    s = set_statistics(tasks)

    def cell(q, width):
      return f"{q['median']:.0f} [{q['q25']:.0f}-{q['q75']:.0f}]".rjust(width)
    rows.append(f"{name:<24} {s['n_tasks']:>5}  {cell(s['prompt_chars'], 22)}  {cell(s['diff_lines'], 18)}  "
                f"{cell(s['diff_files'], 16)}")
  return "\n".join(rows)
