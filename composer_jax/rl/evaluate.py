"""Success rate of a policy on held-out tasks, with a Wilson 95% confidence interval."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rollout import harness
from rollout.engines.protocol import Engine, SamplingParams


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """Wilson score interval of a binomial proportion (sensible at 0% and 100%, unlike the normal one)."""
  if n <= 0:
    raise ValueError(f"need n > 0 trials, got {n}")
  p = successes / n
  denom = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  return max(0.0, centre - half), min(1.0, centre + half)


def success_rate(engine: Engine, tokenizer, tasks: Sequence, envs, hcfg: harness.HarnessConfig,
                 temperature: float, chunk: int = 64) -> dict[str, float]:
  """Solve rate over `tasks` (one episode each) at `temperature` (0 = greedy), with its 95% CI."""
  cfg = dataclasses.replace(hcfg, sampling=SamplingParams(temperature=temperature))
  solved = 0
  for i in range(0, len(tasks), chunk):
    trajs = harness.run_episodes(engine, tokenizer, list(tasks[i:i + chunk]), envs, cfg)
    solved += sum(int(t.metrics.get("solved", 0.0) > 0) for t in trajs)
  lo, hi = wilson(solved, len(tasks))
  return {"success": solved / len(tasks), "ci_low": lo, "ci_high": hi, "n": len(tasks)}
