"""Success rate of a policy on held-out tasks, through the one evaluation runner, with a Wilson 95% interval."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from rollout import harness
from rollout.engines.protocol import Engine, SamplingParams
from rollout.evaluation import runner
from rollout.evaluation.metrics import wilson


def success_rate(engine: Engine, tokenizer, tasks: Sequence, envs, hcfg: harness.HarnessConfig,
                 temperature: float, out_dir: str, policy: str = "policy", chunk: int = 64) -> dict[str, float]:
  """Solve rate over `tasks` (one episode each) at `temperature` (0 = greedy), with its 95% CI.

  Episodes run through `rollout.evaluation.runner.run_policy` (batched chunks, per-task results in `out_dir`, so an
  interrupted evaluation resumes there and a finished one is read back, not re-run).
  """
  cfg = dataclasses.replace(hcfg, sampling=SamplingParams(temperature=temperature))
  records = runner.run_policy(policy, engine, tokenizer, tasks, envs, cfg, out_dir,
                              runner.RunConfig(samples=1, chunk_tasks=chunk), log=lambda s: None)
  solved = sum(int(r["samples"][0]["solved"] > 0) for r in records)
  lo, hi = wilson(solved, len(tasks))
  return {"success": solved / len(tasks), "ci_low": lo, "ci_high": hi, "n": len(tasks)}


def out_dir(workdir: str, policy: str, temperature: float) -> str:
  return os.path.join(workdir, "eval", policy, f"T{temperature:g}")
