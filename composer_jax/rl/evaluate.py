"""Success rate of a policy on held-out tasks, through the one evaluation runner, with a Wilson 95% interval."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import tqdm

from rollout import harness
from rollout.engines.protocol import Engine, SamplingParams
from rollout.evaluation import runner
from rollout.evaluation.metrics import wilson


def success_rate(engine: Engine, tokenizer, tasks: Sequence, envs, hcfg: harness.HarnessConfig,
                 temperature: float, out_dir: str, policy: str = "policy", chunk: int = 256,
                 progress: bool = False) -> dict:
  """Solve rate over `tasks` (one episode each) at `temperature` (0 = greedy), with its 95% CI and the mean
  generated tokens per solved task; for tasks with a procedural `level`, the same figures per level (`levels`).

  Episodes run through `rollout.evaluation.runner.run_policy` (batched chunks, per-task results in `out_dir`, so an
  interrupted evaluation resumes there and a finished one is read back, not re-run); `progress`: a bar over the
  chunks run (500 held-out tasks take minutes). 256 tasks a chunk keep the engine's 64-row calls full while the
  short level-1 episodes end and the level-3 ones go on (`benchmarks/eval_batching.py` measures chunk sizes).
  """
  cfg = dataclasses.replace(hcfg, sampling=SamplingParams(temperature=temperature))
  with tqdm.tqdm(total=len(tasks), desc=f"eval {policy} T={temperature:g}", dynamic_ncols=True,
                 disable=not progress) as bar:
    records = runner.run_policy(policy, engine, tokenizer, tasks, envs, cfg, out_dir,
                                runner.SampleConfig(samples=1, chunk_tasks=chunk), log=lambda s: None,
                                on_chunk=lambda trajs: bar.update(len(trajs)))
  out = _figures([r["samples"][0] for r in records])
  levels = [t.metadata.get("level") for t in tasks]
  if any(lv is not None for lv in levels):  # a procedural mix: the same figures per level
    out["levels"] = {str(lv): _figures([r["samples"][0] for r, l2 in zip(records, levels, strict=True) if l2 == lv])
                     for lv in sorted({lv for lv in levels if lv is not None})}
  return out


def _figures(samples: Sequence[dict]) -> dict:
  """Solve rate with its Wilson 95% CI, and the mean generated tokens per solved task (None if none solved)."""
  won = [s for s in samples if s["solved"] > 0]
  lo, hi = wilson(len(won), len(samples))
  return {"success": len(won) / len(samples), "ci_low": lo, "ci_high": hi, "n": len(samples),
          "tokens_per_solved": sum(s["output_tokens"] for s in won) / len(won) if won else None}


def out_dir(workdir: str, policy: str, temperature: float) -> str:
  return os.path.join(workdir, "eval", policy, f"T{temperature:g}")
