"""Runs one policy on a task set with k samples per task, resumably, writing per-task results as JSONL.

Tasks are cut into fixed chunks of the *full* task list; each chunk's k x tasks episodes are stepped together
(one batched `generate` per step) and its records are appended and fsynced when the chunk finishes. On restart the
finished tasks are read back and skipped, so an interrupted run re-does at most the chunk it was in. The harness
seed of a chunk depends only on its position, so a resumed run samples what an uninterrupted one would have.

Per-sample record: solved, pass_fraction, reward, output_tokens, turns, tool_calls, wall_s (the chunk's wall time
divided by its episodes: episodes run batched, so this is the amortised cost per sample), cost (active parameters x
output tokens, the report's inference-cost proxy; 0 for the scripted baselines, which run no model), stop_reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence

from rollout import harness
from rollout.engines.protocol import Engine
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task

RESULTS = "results.jsonl"
RUN_INFO = "run.json"


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """samples: k per task; chunk_tasks: tasks per batched chunk (and per checkpoint of progress);
  active_params: parameters used per token, for the cost estimate."""
  samples: int = 1
  chunk_tasks: int = 8
  active_params: int = 0

  def __post_init__(self):
    if self.samples < 1 or self.chunk_tasks < 1 or self.active_params < 0:
      raise ValueError(f"need samples >= 1, chunk_tasks >= 1, active_params >= 0; got {self}")


def set_fingerprint(tasks: Sequence[Task]) -> str:
  """A short hash of the task ids in order (a resumed run must see the same set)."""
  return hashlib.sha256("\n".join(t.id for t in tasks).encode()).hexdigest()[:16]


def read_records(out_dir: str) -> dict[str, dict]:
  """Task id -> record of the tasks already finished in `out_dir` (a torn last line from a kill is ignored)."""
  path = os.path.join(out_dir, RESULTS)
  done = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          rec = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut by an interruption; its chunk is re-run
        done[rec["task_id"]] = rec
  return done


def _check_run_info(out_dir: str, info: dict) -> None:
  path = os.path.join(out_dir, RUN_INFO)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
    diff = {k: (old.get(k), v) for k, v in info.items() if old.get(k) != v}
    if diff:
      raise ValueError(f"{out_dir} holds a run with different settings {diff} (old, new); use a new output dir")
  else:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(info, f, indent=1)


def _sample(traj, wall_s: float, active_params: int) -> dict:
  m = traj.metrics
  return {"solved": float(m["solved"]), "pass_fraction": float(m["pass_fraction"]), "reward": float(traj.reward),
          "output_tokens": int(m["output_tokens"]), "turns": int(m["turns"]), "tool_calls": int(m["tool_calls"]),
          "wall_s": wall_s, "cost": float(active_params) * int(m["output_tokens"]), "stop_reason": traj.stop_reason,
          "grade_error": m.get("grade_error", "")}


def run_policy(policy: str, engine: Engine, tokenizer, tasks: Sequence[Task], envs: EnvironmentCache,
               harness_cfg: harness.HarnessConfig, out_dir: str, cfg: RunConfig = RunConfig(),
               log: Callable[[str], None] = print) -> list[dict]:
  """Evaluates `engine` on `tasks`, resuming from `out_dir`.

  Args:
    policy: a name recorded with each result.
    engine: anything implementing the engine protocol.
    tokenizer: the tokenizer the engine speaks.
    tasks: the (validated) task set.
    envs: environment cache.
    harness_cfg: harness limits and sampling; its seed is the base seed.
    out_dir: where results.jsonl and run.json go (created).
    cfg: k, chunking, active parameters.
    log: progress lines.

  Returns:
    One record per task in task order: {task_id, policy, samples: [per-sample dict]}.
  """
  if len({t.id for t in tasks}) != len(tasks):
    raise ValueError("task ids must be unique within a set")
  os.makedirs(out_dir, exist_ok=True)
  _check_run_info(out_dir, {"policy": policy, "set": set_fingerprint(tasks), "samples": cfg.samples,
                            "chunk_tasks": cfg.chunk_tasks, "seed": harness_cfg.seed})
  done = read_records(out_dir)
  if done:
    log(f"[{policy}] resuming: {len(done)}/{len(tasks)} tasks already done")
  for c0 in range(0, len(tasks), cfg.chunk_tasks):
    chunk = [t for t in tasks[c0:c0 + cfg.chunk_tasks] if t.id not in done]
    if not chunk:
      continue
    episodes = [t for t in chunk for _ in range(cfg.samples)]
    seeded = dataclasses.replace(harness_cfg, seed=harness_cfg.seed * 1_000_003 + c0)
    t0 = time.perf_counter()
    trajs = harness.run_episodes(engine, tokenizer, episodes, envs, seeded)
    wall = (time.perf_counter() - t0) / len(episodes)
    lines = []
    for i, t in enumerate(chunk):
      samples = [_sample(tr, wall, cfg.active_params) for tr in trajs[i * cfg.samples:(i + 1) * cfg.samples]]
      rec = {"task_id": t.id, "policy": policy, "samples": samples}
      done[t.id] = rec
      lines.append(json.dumps(rec) + "\n")
    with open(os.path.join(out_dir, RESULTS), "a", encoding="utf-8") as f:
      f.writelines(lines)
      f.flush()
      os.fsync(f.fileno())
    solved = sum(s["solved"] for r in (done[t.id] for t in chunk) for s in r["samples"])
    log(f"[{policy}] tasks {c0}-{c0 + len(tasks[c0:c0 + cfg.chunk_tasks]) - 1}: {solved:.0f}/{len(episodes)} "
        f"samples solved, {wall:.2f} s/sample; {len(done)}/{len(tasks)} done")
  return [done[t.id] for t in tasks]
