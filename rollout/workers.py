"""Engine-agnostic rollout workers: take tasks, roll out groups of G samples, append each group to the queue.

A worker has a stable id, a deterministic task stream (`task_pool[(index * n_workers + worker) % len]`) and a
small state file holding the next stream index, written *after* the group is visible in the queue. A worker
killed mid-group loses only that unfinished group (it never reached the queue) and redoes the same task on
restart; one killed between the append and the state write rolls that task out once more — a new sample, not a
copy of a queued trajectory, so the trainer still sees every queued trajectory exactly once.

Nothing here imports jax: the engine (embedded JAX, SGLang fleet, scripted) is passed in, and `refresh` is the
hook that swaps in newly published weights between groups.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence

from rollout import harness
from rollout.engines.protocol import Engine
from rollout.queue import QueueProducer
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """Which slice of the task stream a worker rolls out and how many samples per task."""
  worker_index: int = 0
  n_workers: int = 1
  samples_per_prompt: int = 4
  max_groups: int | None = None      # stop after this many groups (None: until `should_stop`)

  def __post_init__(self):
    if not 0 <= self.worker_index < self.n_workers:
      raise ValueError(f"worker_index={self.worker_index} must be in [0, n_workers={self.n_workers})")
    if self.samples_per_prompt < 2:
      raise ValueError(f"samples_per_prompt={self.samples_per_prompt}: group advantages need >= 2 samples")

  @property
  def producer_id(self) -> str:
    return f"worker{self.worker_index}"


def task_at(pool: Sequence[Task], cfg: WorkerConfig, index: int) -> Task:
  """The `index`-th task of this worker's stream."""
  return pool[(index * cfg.n_workers + cfg.worker_index) % len(pool)]


def _read_index(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return int(json.load(f)["next"])


def _write_index(path: str, index: int) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"next": index}, f)
  os.replace(tmp, path)   # atomic: a kill leaves the old or the new index, never half a file


def rollout_group(engine: Engine, tokenizer, task: Task, envs: EnvironmentCache, hcfg: harness.HarnessConfig,
                  samples: int, seed: int) -> list:
  """G trajectories of one task (seeds differ per sample through the harness's per-episode seeds)."""
  cfg = dataclasses.replace(hcfg, seed=seed)
  return harness.run_episodes(engine, tokenizer, [task] * samples, envs, cfg)


def run_worker(engine: Engine, tokenizer, pool: Sequence[Task], envs: EnvironmentCache,
               hcfg: harness.HarnessConfig, producer: QueueProducer, cfg: WorkerConfig, state_path: str, *,
               refresh: Callable[[], None] = lambda: None, should_stop: Callable[[], bool] = lambda: False,
               log_fn: Callable[[str], None] = lambda s: None) -> int:
  """Rolls out groups until `max_groups` or `should_stop()`; returns how many groups it appended.

  Args:
    engine: generates tokens; `refresh()` is called before each group (load newer weights if published).
    pool: the task pool; this worker takes every `n_workers`-th task from `worker_index`.
    producer: appends groups (its id should be `cfg.producer_id`).
    state_path: the JSON file holding the next stream index (resumes there after a restart).
  """
  if not pool:
    raise ValueError("run_worker needs a non-empty task pool")
  index = _read_index(state_path)
  done = 0
  while not should_stop() and (cfg.max_groups is None or done < cfg.max_groups):
    refresh()
    task = task_at(pool, cfg, index)
    t0 = time.perf_counter()
    trajs = rollout_group(engine, tokenizer, task, envs, hcfg, cfg.samples_per_prompt,
                          seed=index * cfg.n_workers + cfg.worker_index)
    key = producer.append_group([t.to_dict() for t in trajs], task_id=task.id, stream_index=index,
                                rollout_s=time.perf_counter() - t0, level=task.metadata.get("level"))
    index += 1
    _write_index(state_path, index)
    done += 1
    log_fn(f"{cfg.producer_id}: group {index - 1} ({task.id}) -> {key}, "
           f"solved {sum(float(t.metrics.get('solved', 0)) for t in trajs):.0f}/{len(trajs)}")
  return done
