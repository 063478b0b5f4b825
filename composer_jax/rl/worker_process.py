"""The rollout worker process: `python -m composer_jax.rl.worker_process <workdir> <worker_index>`.

It reads the run's pickled `RunConfig`, gets its engine from the run's publisher registry (`publishers.follow`: a
`JaxEngine` on the published weight files, reloading newer ones, or a client of the trainer's SGLang fleet) and runs
`rollout.workers.run_worker`, throttled to what the trainer can use before it goes stale. It asks the kernel to
SIGKILL it when its parent (the trainer) dies, so a killed trainer never leaves a second producer with the same id
running beside the restarted one's workers. It touches `workers/worker<i>.beat` before each group and while it waits
for new weights, so the trainer's supervisor (`sources.WorkerPool`) tells a group that hangs from a worker that is
throttled.
"""
from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import time
from collections.abc import Callable


def _die_with_parent() -> None:
  PR_SET_PDEATHSIG = 1
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  except OSError:
    pass   # not Linux/glibc: the trainer's supervisor still stops workers on a clean exit


def beat_path(workdir: str, worker_index: int) -> str:
  """The file worker `worker_index` touches while it is not inside a group (its mtime: the last sign of life)."""
  return os.path.join(workdir, "workers", f"worker{worker_index}.beat")


def beat(path: str) -> None:
  with open(path, "a"):
    os.utime(path)


def throttle(follower, per_version: int, stopping: Callable[[], bool],
             heartbeat: Callable[[], None] = lambda: None) -> Callable[[], None]:
  """The worker's `refresh`: load newer weights, then allow at most `per_version` groups per policy version.

  Without it a fast worker floods the queue with groups that are then dropped as stale; it waits (polling) until the
  trainer publishes a newer version, or until the worker is told to stop. `heartbeat` is called on every poll, so
  waiting here never looks like a hung group.
  """
  made = {"version": follower.version(), "groups": 0}

  def refresh() -> None:
    while True:
      heartbeat()
      follower.load_newer()
      if made["version"] != follower.version():
        made.update(version=follower.version(), groups=0)
      if made["groups"] < per_version or stopping():
        made["groups"] += 1
        return
      time.sleep(0.05)

  return refresh


def main(workdir: str, worker_index: int) -> None:
  ppid = os.getppid()
  _die_with_parent()
  from composer_jax.compile_cache import enable_compilation_cache
  enable_compilation_cache()   # the trainer's cache directory (exported to this process)
  from composer_jax.rl import publishers, setup
  from composer_jax.rl import workdir as workdir_lib
  from rollout import workers
  from rollout.queue import QueueProducer

  cfg = workdir_lib.load_run_config(workdir)
  sdir = os.path.join(workdir, "workers")
  stopping = lambda: os.getppid() != ppid or os.path.exists(os.path.join(sdir, "STOP"))
  follower = publishers.follow(cfg)
  r = cfg.rollout
  per_version = max(1, math.ceil(cfg.rl.groups_per_step * (r.max_staleness + 1) / r.workers))
  wcfg = workers.WorkerConfig(worker_index=worker_index, n_workers=r.workers, samples_per_prompt=r.samples_per_prompt,
                              tree=r.tree)
  os.makedirs(sdir, exist_ok=True)
  with open(os.path.join(sdir, f"{wcfg.producer_id}.pid"), "w") as f:
    f.write(str(os.getpid()))
  with setup.open_run(cfg) as run:   # the trainer's tokenizer and pool, workspaces of this worker's own
    workers.run_worker(follower.engine, run.tokenizer, run.pool, run.envs, cfg.harness,
                       QueueProducer(setup.queue_url(cfg.workdir), wcfg.producer_id), wcfg,
                       os.path.join(sdir, f"{wcfg.producer_id}.json"),
                       refresh=throttle(follower, per_version, stopping,
                                        lambda: beat(beat_path(workdir, worker_index))), should_stop=stopping,
                       log_fn=lambda s: print(s, flush=True))


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
