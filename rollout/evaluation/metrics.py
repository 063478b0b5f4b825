"""Benchmark metrics over k samples per task: pass@1 with a confidence interval, unbiased pass@k, means.

Shapes: N tasks, K samples per task. `solved_NxK` is 0/1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got {n=} {c=} {k=}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
  """Wilson score interval of a binomial proportion (sensible at 0% and 100%, unlike the normal one)."""
  if n <= 0:
    raise ValueError(f"need n > 0 trials, got {n}")
  p = successes / n
  denom = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  return max(0.0, centre - half), min(1.0, centre + half)


def pass1_ci(per_task_rates: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
  """(mean, low, high) of pass@1: the mean over tasks of each task's success rate over its samples.

  The interval is the normal approximation over tasks (samples of one task are correlated, so tasks are the
  independent units; this is the clustered standard error), clipped to [0, 1], widened to the Wilson interval of
  the mean over n tasks where that is wider: at 0% or 100% the standard error is 0, and "0 of 50 tasks" must still
  allow a rate up to ~7%. With one task the interval is the point.
  """
  r = np.asarray(per_task_rates, np.float64)
  if r.size == 0:
    raise ValueError("pass1_ci needs at least one task")
  mean = float(r.mean())
  if r.size == 1:
    return mean, mean, mean
  se = float(r.std(ddof=1)) / math.sqrt(r.size)
  w_lo, w_hi = wilson(mean * r.size, r.size, z)
  return mean, max(0.0, min(mean - z * se, w_lo)), min(1.0, max(mean + z * se, w_hi))


def summarize(records: Sequence[dict], ks: Sequence[int] = (1,)) -> dict[str, float]:
  """Set-level metrics from per-task records (see `runner.run_policy`): each has `samples`, a list of dicts with
  solved, output_tokens, turns, tool_calls, wall_s, cost.

  Returns:
    n_tasks, samples_per_task, pass@1 (+ _lo/_hi 95% interval), pass@k for each k <= samples, grade_timeouts (the
    number of samples whose grading hit its time limit: not the policy's failure, so reported on their own), and
    per-sample means of reward, output_tokens, turns, tool_calls, wall_s and cost (active parameters x output tokens).
  """
  if not records:
    raise ValueError("no task records to summarize")
  n_samples = {len(r["samples"]) for r in records}
  if len(n_samples) != 1:
    raise ValueError(f"tasks have different sample counts {sorted(n_samples)}; evaluate with one k")
  k_all = n_samples.pop()
  solved_NxK = np.asarray([[s["solved"] for s in r["samples"]] for r in records], np.float64)
  mean, lo, hi = pass1_ci(solved_NxK.mean(axis=1))
  out = {"n_tasks": float(len(records)), "samples_per_task": float(k_all), "pass@1": mean, "pass@1_lo": lo,
         "pass@1_hi": hi}
  for k in sorted(set(ks) | {k_all}):
    if 1 < k <= k_all:
      out[f"pass@{k}"] = float(np.mean([pass_at_k(k_all, int(c), k) for c in solved_NxK.sum(axis=1)]))
  out["grade_timeouts"] = float(sum(bool(s.get("grade_timed_out")) for r in records for s in r["samples"]))
  for key in ("reward", "output_tokens", "turns", "tool_calls", "wall_s", "cost"):
    out[key] = float(np.mean([s.get(key, 0.0) for r in records for s in r["samples"]]))
  return out
