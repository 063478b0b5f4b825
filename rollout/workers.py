"""Engine-agnostic rollout workers: take tasks, roll out groups of G samples, append each group to the queue.

A worker has a stable id, a deterministic task stream (`task_pool[(index * n_workers + worker) % len]`) and a
small state file holding the next stream index, written *after* the group is visible in the queue. A worker
killed mid-group loses only that unfinished group (it never reached the queue) and redoes the same task on
restart; one killed between the append and the state write rolls that task out once more — a new sample, not a
copy of a queued trajectory, so the trainer still sees every queued trajectory exactly once.

A group reaches the queue whole and graded, or not at all: if a sandbox does not start or a grader times out in
the middle of a group, the whole group is rolled out again (`group_attempts` tries), then dropped. Each retry and
drop is counted in the queue (`QueueProducer.count`: `sandbox_start_failures`, `grade_timeouts`, `groups_retried`,
`groups_dropped`, in the trainer's metrics) and logged; a timed-out grade is never trained on as a reward of 0.

Nothing here imports jax: the engine (embedded JAX, SGLang fleet, scripted) is passed in, and `refresh` is the
hook that swaps in newly published weights between groups.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence

from rollout import harness, tree_harness
from rollout.engines.protocol import Engine
from rollout.queue import QueueProducer
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task
from rollout.tree_harness import TreeConfig


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """Which slice of the task stream a worker rolls out and how many samples per task."""
  worker_index: int = 0
  n_workers: int = 1
  samples_per_prompt: int = 4
  max_groups: int | None = None      # stop after this many groups (None: until `should_stop`)
  group_attempts: int = 2            # tries per group when a sandbox fails to start or a grade times out
  max_drops_in_a_row: int = 10       # then stop with an error: the sandboxes or graders are broken, not one task
  tree: TreeConfig | None = None     # sample each group as a tree (`rollout.tree_harness`) of samples_per_prompt leaves

  def __post_init__(self):
    if not 0 <= self.worker_index < self.n_workers:
      raise ValueError(f"worker_index={self.worker_index} must be in [0, n_workers={self.n_workers})")
    if self.group_attempts < 1 or self.max_drops_in_a_row < 1:
      raise ValueError(f"need group_attempts >= 1 and max_drops_in_a_row >= 1, got {self.group_attempts=} "
                       f"{self.max_drops_in_a_row=}")
    if self.samples_per_prompt < 2:
      raise ValueError(f"samples_per_prompt={self.samples_per_prompt}: group advantages need >= 2 samples")
    if self.tree is not None and self.tree.size != self.samples_per_prompt:
      raise ValueError(f"tree fanouts {self.tree.fanouts} give {self.tree.size} leaves per group, but "
                       f"samples_per_prompt={self.samples_per_prompt}: the leaves are the group's samples")

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
                  samples: int, seed: int, tree: TreeConfig | None = None) -> list:
  """G trajectories of one task (seeds differ per sample through the harness's per-episode seeds); with `tree`,
  the leaves of one tree of G (`rollout.tree_harness`)."""
  cfg = dataclasses.replace(hcfg, seed=seed)
  if tree is not None:
    return tree_harness.rollout_tree(engine, tokenizer, task, envs, cfg, tree)
  return harness.run_episodes(engine, tokenizer, [task] * samples, envs, cfg)


class GroupsKeepFailing(RuntimeError):
  """`max_drops_in_a_row` groups in a row were dropped: a broken sandbox backend or grader, not a bad task."""


def whole_group(engine: Engine, tokenizer, task: Task, envs: EnvironmentCache, hcfg: harness.HarnessConfig,
                cfg: WorkerConfig, seed: int, producer: QueueProducer,
                log_fn: Callable[[str], None]) -> tuple[list | None, int, str]:
  """(trajectories, attempts, last failure): a complete, fully graded group, or None after `group_attempts` tries.

  Every failed try is counted under its cause, a group that needed more than one try under `groups_retried`, one
  that never completed under `groups_dropped`.
  """
  failure = ""
  for attempt in range(1, cfg.group_attempts + 1):
    try:
      trajs = rollout_group(engine, tokenizer, task, envs, hcfg, cfg.samples_per_prompt, seed, cfg.tree)
    except harness.SandboxStartError as e:
      cause, failure = "sandbox_start_failures", str(e)
    else:
      timed_out = sum(t.metrics.get("grade_timed_out", 0.0) > 0 for t in trajs)
      if not timed_out:
        if attempt > 1:
          producer.count("groups_retried")
        return trajs, attempt, ""
      cause, failure = "grade_timeouts", f"{timed_out}/{len(trajs)} grades of {task.id} timed out"
    producer.count(cause)
    log_fn(f"{cfg.producer_id}: group of {task.id}, try {attempt}/{cfg.group_attempts} failed ({cause}): "
           f"{failure}")
  producer.count("groups_dropped")
  return None, cfg.group_attempts, failure


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

  Raises:
    GroupsKeepFailing: `cfg.max_drops_in_a_row` groups in a row could not be completed.
  """
  if not pool:
    raise ValueError("run_worker needs a non-empty task pool")
  index = _read_index(state_path)
  done = drops = 0
  while not should_stop() and (cfg.max_groups is None or done < cfg.max_groups):
    refresh()
    task = task_at(pool, cfg, index)
    t0 = time.perf_counter()
    trajs, attempts, failure = whole_group(engine, tokenizer, task, envs, hcfg, cfg,
                                           index * cfg.n_workers + cfg.worker_index, producer, log_fn)
    index += 1
    if trajs is None:
      _write_index(state_path, index)
      drops += 1
      log_fn(f"{cfg.producer_id}: group {index - 1} ({task.id}) dropped after {attempts} tries")
      if drops >= cfg.max_drops_in_a_row:
        raise GroupsKeepFailing(f"{cfg.producer_id}: {drops} groups in a row dropped; the last: {failure}")
      continue
    drops = 0
    key = producer.append_group([t.to_dict() for t in trajs], task_id=task.id, stream_index=index - 1,
                                rollout_s=time.perf_counter() - t0, level=task.metadata.get("level"),
                                attempts=attempts)
    _write_index(state_path, index)
    done += 1
    log_fn(f"{cfg.producer_id}: group {index - 1} ({task.id}) -> {key}, "
           f"solved {sum(float(t.metrics.get('solved', 0)) for t in trajs):.0f}/{len(trajs)}")
  return done
