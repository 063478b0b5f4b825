"""Rollout sources: where a trainer step's groups come from, behind one protocol, chosen by `rollout.mode`.

  sync    InProcess   roll the step's groups out here with the current policy (the publisher's engine), then take
                      them from the queue: staleness 0, the trainer waits for every rollout
  async   WorkerPool  worker processes (`python -m composer_jax.rl.worker_process`) fill the queue while the
                      trainer trains; the trainer only waits when the queue has too few fresh groups (a dead
                      worker is restarted, a hung one — no heartbeat for `rollout.stall_timeout_s` — killed and
                      restarted)

Either way groups pass through the same tensorstore queue, so the consumer's cursor, the staleness filter and the
exactly-once bookkeeping are the same code in both modes.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Protocol

from composer_jax.rl import batch as rl_batch
from composer_jax.rl import placement, setup
from composer_jax.rl import worker_process as worker_lib
from composer_jax.rl.config import RunConfig
from rollout import workers
from rollout.queue import QueueConsumer, QueueProducer


class Source(Protocol):
  def next(self, policy_version: int) -> tuple[list, float]:
    """The next step's whole groups for a trainer at `policy_version`, and the seconds spent rolling out here."""

  def close(self) -> None: ...


def take_groups(consumer: QueueConsumer, cfg: RunConfig, policy_version: int, wait=lambda: None) -> list:
  """Polls `consumer` for one step's whole groups (`wait()` between polls while it is short): `rl.groups_per_step`
  of them, or fewer when the next one does not fit in what is left of the step's `cfg.batch_rows` segments (a
  self-summarising chain has one per context) or, packed, does not pack into the `rl.pack_rows` rows with the
  ones before it; that group opens the next step. A group too large to pack alone gets a step of its own.

  Never fewer for any other reason: while workers are slow the step waits for its groups. That the next group does
  not fit is read from the poll itself (`consumer.held_back`), not from a `depth()` after it, which would also count
  a group a worker appended in between and end the step short."""
  groups, rows = [], 0
  bcfg = placement.batch_config(cfg)
  packer = rl_batch.Packer(bcfg.pack_rows, bcfg.length, bcfg.rows)
  packed = {"groups": 0, "alone": False}   # `alone`: the step is one group too large for pack_rows

  def packs(g) -> bool:
    if packed["alone"]:
      return False
    if packer.add(rl_batch.segment_lengths(g.trajectories(), bcfg)) is not None:
      packed["groups"] += 1
      return True
    packed["alone"] = packed["groups"] == 0   # make_batch gives it batch_rows rows, a row per segment
    return packed["alone"]

  while len(groups) < cfg.rl.groups_per_step:
    got = consumer.poll(policy_version, max_groups=cfg.rl.groups_per_step - len(groups), max_rows=cfg.batch_rows - rows,
                        batch_rows=cfg.batch_rows, fits=packs if bcfg.pack_rows else None)
    groups += got
    rows += sum(g.key.n_rows for g in got)
    if consumer.held_back is not None:   # the oldest pending group does not fit: it opens the next step
      break
    if len(groups) < cfg.rl.groups_per_step:
      wait()
      time.sleep(0.05)
  return groups


class InProcess:
  """Sync rollouts in the trainer's process with `engine` (kept current by the in_place or fleet publisher)."""

  def __init__(self, cfg: RunConfig, engine, run: setup.Run, consumer: QueueConsumer, log_fn=print):
    if engine is None:
      raise ValueError(f"rollout.mode='sync' needs an in-process engine; engine {cfg.rollout.engine!r} has none")
    self.cfg, self.engine, self.run, self.consumer = cfg, engine, run, consumer
    self.producer = QueueProducer(setup.queue_url(cfg.workdir), "sync0")
    self.wcfg = workers.WorkerConfig(samples_per_prompt=cfg.rollout.samples_per_prompt,
                                     max_groups=cfg.rl.groups_per_step, tree=cfg.rollout.tree)

  def next(self, policy_version: int) -> tuple[list, float]:
    t0 = time.perf_counter()
    workers.run_worker(self.engine, self.run.tokenizer, self.run.pool, self.run.envs, self.cfg.harness, self.producer,
                       self.wcfg, os.path.join(self.cfg.workdir, "sync0.json"))
    rollout_s = time.perf_counter() - t0
    return take_groups(self.consumer, self.cfg, policy_version), rollout_s

  def close(self) -> None:
    pass   # the run's workspaces are `setup.open_run`'s to close


class WorkersHung(RuntimeError):
  """Every worker's groups hang: restarts did not help, and waiting longer would wait forever."""


class WorkerPool:
  """Worker processes, restarted if one dies or hangs (its unfinished group is redone; nothing queued is lost).

  A worker hangs when its heartbeat (`worker.beat_path`, touched between groups) is older than
  `rollout.stall_timeout_s`: it is killed with its process group and restarted. Restarts and stalls are counted in
  the queue (`worker_restarts`, `worker_stalls`: the trainer's metrics, beside `trainer_idle_s`); when the workers
  stalled 2 × `rollout.workers` times with no group finished in between, `next` raises `WorkersHung`.
  """

  def __init__(self, cfg: RunConfig, engine, run: setup.Run, consumer: QueueConsumer, log_fn=print):
    self.cfg, self.consumer, self.log_fn = cfg, consumer, log_fn
    self.logs = os.path.join(cfg.workdir, "workers")
    os.makedirs(self.logs, exist_ok=True)
    stop = os.path.join(self.logs, "STOP")
    if os.path.exists(stop):
      os.remove(stop)
    self.counts = QueueProducer(setup.queue_url(cfg.workdir), "supervisor")   # appends nothing: only `count`s
    self.started: dict[int, float] = {}
    self.procs = [self._start(i) for i in range(cfg.rollout.workers)]
    self.restarts = 0
    self.stalls, self._last_done = 0, self._newest_group_done()   # stalls since a worker last finished a group

  def command(self, i: int) -> list[str]:
    return [sys.executable, "-m", "composer_jax.rl.worker_process", self.cfg.workdir, str(i)]

  def _start(self, i: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    out = open(os.path.join(self.logs, f"worker{i}.log"), "a")
    self.started[i] = time.time()
    # Its own process group: a hung worker is killed with whatever it started.
    return subprocess.Popen(self.command(i), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

  def _mtime(self, path: str) -> float:
    try:
      return os.path.getmtime(path)
    except FileNotFoundError:
      return 0.0

  def _newest_group_done(self) -> float:
    """When a worker last finished (queued or dropped) a group: the newest of their stream-index files."""
    return max(self._mtime(os.path.join(self.logs, f"worker{i}.json")) for i in range(self.cfg.rollout.workers))

  def _restart(self, i: int, why: str, counter: str) -> None:
    self.log_fn(f"worker{i} {why}; restarting it (see {self.logs}/worker{i}.log)")
    self.counts.count(counter)
    self.procs[i] = self._start(i)

  def check(self) -> None:
    """Restarts dead and hung workers; raises when they keep dying or every one of them keeps hanging."""
    timeout = self.cfg.rollout.stall_timeout_s
    done = self._newest_group_done()
    if done > self._last_done:
      self.stalls, self._last_done = 0, done
    for i, p in enumerate(self.procs):
      if p.poll() is not None:
        self.restarts += 1
        if self.restarts > 10 * self.cfg.rollout.workers:
          raise RuntimeError(f"workers keep dying; see {self.logs}/worker*.log")
        self._restart(i, f"exited with {p.returncode}", "worker_restarts")
        continue
      quiet = time.time() - max(self.started[i], self._mtime(worker_lib.beat_path(self.cfg.workdir, i)))
      if quiet > timeout:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        self.stalls += 1
        self._restart(i, f"started no group for {quiet:.0f} s (rollout.stall_timeout_s={timeout:g}): its group "
                      "hangs; killed", "worker_stalls")
    if self.stalls >= 2 * len(self.procs):
      raise WorkersHung(f"{self.stalls} worker stalls (no heartbeat for rollout.stall_timeout_s={timeout:g} s) and "
                        f"no group finished since: every worker's groups hang; see {self.logs}/worker*.log")

  def next(self, policy_version: int) -> tuple[list, float]:
    return take_groups(self.consumer, self.cfg, policy_version, wait=self.check), 0.0

  def close(self) -> None:
    open(os.path.join(self.logs, "STOP"), "w").close()
    for p in self.procs:
      p.terminate()
    for p in self.procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        p.kill()


SOURCES = {"sync": InProcess, "async": WorkerPool}


def make(cfg: RunConfig, engine, run: setup.Run, consumer: QueueConsumer, log_fn=print) -> Source:
  """The rollout source of `rollout.mode` (`engine`: the publisher's in-process engine, and `run`'s tokenizer, pool
  and workspaces, used by sync)."""
  if cfg.rollout.mode not in SOURCES:
    raise ValueError(f"unknown rollout.mode {cfg.rollout.mode!r}; valid: {sorted(SOURCES)}")
  return SOURCES[cfg.rollout.mode](cfg, engine, run, consumer, log_fn)
