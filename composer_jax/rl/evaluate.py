"""Success rate of a policy on held-out tasks, with a Wilson 95% confidence interval."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rollout import harness
from rollout.engines.protocol import Engine, SamplingParams
from rollout.evaluation.metrics import wilson


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
