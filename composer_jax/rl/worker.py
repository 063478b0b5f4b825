"""The rollout worker process: `python -m composer_jax.rl.worker <workdir> <worker_index>`.

It reads the run's pickled `RunConfig`, waits for the first published weights, builds a `JaxEngine` on them and
runs `rollout.workers.run_worker`, reloading weights whenever the trainer publishes a newer version. With
`engine='sglang'` it attaches to the trainer's SGLang fleet instead (`rl/fleet.py`): the trainer pushes weights to
the servers, and the worker only follows the served version (for its per-version throttle). It asks the
kernel to SIGKILL it when its parent (the trainer) dies, so a killed trainer never leaves a second producer with
the same id running beside the restarted one's workers.
"""
from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import time


def _die_with_parent() -> None:
  PR_SET_PDEATHSIG = 1
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  except OSError:
    pass   # not Linux/glibc: the trainer's supervisor still stops workers on a clean exit


def engine_config(cfg):
  from composer_jax.sampling.engine import EngineConfig
  # Fixed buckets: one group per call, prompts padded to the context budget, turns to max_turn_tokens.
  return EngineConfig(min_batch_bucket=cfg.rollout.samples_per_prompt,
                      min_prompt_bucket=cfg.harness.context_budget // 2,
                      min_len_bucket=cfg.harness.max_turn_tokens, seed=cfg.seed)


def main(workdir: str, worker_index: int) -> None:
  ppid = os.getppid()
  _die_with_parent()
  import jax

  from composer_jax import model
  from composer_jax.rl import publish, setup
  from composer_jax.sampling.engine import JaxEngine
  from rollout import workers
  from rollout.queue import QueueProducer

  cfg = setup.load_run_config(workdir)
  tok = setup.load_tokenizer(cfg)
  pool = setup.train_pool(cfg)
  envs = setup.make_envs(cfg)
  wdir = os.path.join(workdir, "weights")
  if cfg.rollout.engine == "sglang":
    # The trainer's fleet: it pushes new weights to the servers; each sample reports the version that made it.
    from composer_jax.rl import fleet as fleet_lib
    engine = fleet_lib.attach(cfg)

    def current_version() -> int:
      v = fleet_lib.served_version(workdir)
      return engine.policy_version if v is None else v

    def load_newer() -> None:
      pass
  else:
    while publish.latest(wdir) is None:
      time.sleep(0.2)
    like = jax.eval_shape(lambda: model.init(jax.random.key(0), cfg.model))
    version, path = publish.latest(wdir)
    # Committed to one device from the start, as `update_weights` places later versions: no recompile on update.
    dev = jax.devices()[0]
    engine = JaxEngine(jax.device_put(publish.load(path, like), dev), cfg.model, engine_config(cfg),
                       policy_version=version)

    def current_version() -> int:
      return engine.policy_version

    def load_newer() -> None:
      while (got := publish.latest(wdir)) is not None and got[0] > engine.policy_version:
        try:
          engine.update_weights(jax.device_put(publish.load(got[1], like)), policy_version=got[0])
        except FileNotFoundError:
          continue   # pruned between the pointer read and the load: a newer one is there

  # Throttle: at most this many groups per policy version, i.e. what the trainer can use before they go stale.
  # Without it a fast worker floods the queue with groups that are then dropped as stale.
  per_version = max(1, math.ceil(cfg.train.groups_per_step * (cfg.rollout.max_staleness + 1) / cfg.rollout.workers))
  made = {"version": current_version(), "groups": 0}
  stop_file = os.path.join(workdir, "workers", "STOP")

  def refresh() -> None:
    while True:
      load_newer()
      if made["version"] != current_version():
        made.update(version=current_version(), groups=0)
      if made["groups"] < per_version or os.getppid() != ppid or os.path.exists(stop_file):
        made["groups"] += 1
        return
      time.sleep(0.05)

  wcfg = workers.WorkerConfig(worker_index=worker_index, n_workers=cfg.rollout.workers,
                              samples_per_prompt=cfg.rollout.samples_per_prompt)
  producer = QueueProducer(f"file://{os.path.join(os.path.abspath(workdir), 'queue')}", wcfg.producer_id)
  sdir = os.path.join(workdir, "workers")
  os.makedirs(sdir, exist_ok=True)
  with open(os.path.join(sdir, f"{wcfg.producer_id}.pid"), "w") as f:
    f.write(str(os.getpid()))
  try:
    workers.run_worker(engine, tok, pool, envs, cfg.harness, producer, wcfg,
                       os.path.join(sdir, f"{wcfg.producer_id}.json"), refresh=refresh,
                       should_stop=lambda: os.getppid() != ppid or os.path.exists(os.path.join(sdir, "STOP")),
                       log_fn=lambda s: print(s, flush=True))
  finally:
    envs.factory.close()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
