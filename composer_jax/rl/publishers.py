"""How new policy versions reach the engines that generate rollouts; both ends of each channel, in a registry.

  publisher   trainer side: `publish(params, version) -> seconds`    worker side: `follow(cfg) -> Follower`
  in_place    the in-process JaxEngine's weights are swapped         (no workers: sync mode)
  files       `weights/v<version>.npz` + an atomic pointer           each worker's JaxEngine reloads newer files
  fleet       a Hugging Face checkpoint loaded by the SGLang fleet   workers attach to the fleet (`rl/fleet.py`)

Which publisher a run uses follows from its engine and mode (`ENGINES`); `make` and `follow` look it up and list
the valid names on a bad one. `publisher.engine` is the engine an in-process (sync) rollout source generates with.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

import jax

from composer_jax import model
from composer_jax.parallel import distributed
from composer_jax.rl import fleet, processes, weight_files
from composer_jax.rl.config import ENGINES, RunConfig
from composer_jax.rl.follower import Follower


class Publisher(Protocol):
  engine: object | None    # the engine an in-process rollout source uses (None: only worker processes generate)

  def publish(self, params, version: int) -> float: ...

  def close(self) -> None: ...


def engine_config(cfg: RunConfig):
  """The embedded engine's fixed buckets: one group per call, prompts padded to half the context budget, turns to
  max_turn_tokens (so every call reuses one compiled program); MTP speculative decoding per `rollout.draft_tokens`."""
  from composer_jax.sampling.engine import EngineConfig
  return EngineConfig(min_batch_bucket=cfg.rollout.samples_per_prompt,
                      min_prompt_bucket=cfg.harness.context_budget // 2,
                      min_len_bucket=cfg.harness.max_turn_tokens, seed=cfg.seed,
                      speculative=cfg.rollout.draft_tokens > 0, draft_tokens=max(1, cfg.rollout.draft_tokens),
                      adaptive_draft=cfg.rollout.adaptive_draft)


def engine_stats_dir(cfg: RunConfig) -> str:
  """Where rollout engines append their speculative counts per policy version (`sampling/spec_log.py`)."""
  return os.path.join(cfg.workdir, "engines")


def _rollout_engine(cfg: RunConfig, params, version: int, name: str, log_fn=None, **placement):
  from composer_jax.sampling.engine import JaxEngine
  return JaxEngine(params, cfg.model, engine_config(cfg), policy_version=version, name=name, log_fn=log_fn,
                   stats_path=os.path.join(engine_stats_dir(cfg), f"{name}.jsonl"), **placement)


def weights_dir(cfg: RunConfig) -> str:
  return os.path.join(cfg.workdir, "weights")


class InPlace:
  """Sync mode with the embedded engine: the trainer's own JaxEngine gets each version's params directly.

  Across processes, process 0 alone rolls out: its engine holds a replica of the gathered params on each of its
  own devices (`processes.for_local_engine`; every process takes part in the gather), the others have none."""

  def __init__(self, cfg: RunConfig, params, version: int, log_fn=print):
    mesh = jax.tree.leaves(params)[0].sharding.mesh   # the trainer's
    placement = cfg.rollout.engine_placement
    params, local_mesh = processes.for_local_engine(params)
    if local_mesh is not None:
      mesh, placement = local_mesh, "replicas"
    self.engine = _rollout_engine(cfg, params, version, "trainer", log_fn if cfg.rollout.draft_tokens else None,
                                  mesh=mesh, placement=placement) if distributed.is_primary() else None

  def publish(self, params, version: int) -> float:
    t0 = time.perf_counter()
    params, _ = processes.for_local_engine(params)
    if self.engine is not None:
      self.engine.update_weights(params, version)
    return time.perf_counter() - t0

  def close(self) -> None:
    if self.engine is not None:
      self.engine.close()

  @staticmethod
  def follow(cfg: RunConfig) -> Follower:
    raise ValueError("the in_place publisher has no worker processes (rollout.mode='sync')")


class WeightFiles:
  """Async mode with the embedded engine: one `.npz` per version; workers poll `weights/latest.json`."""
  engine = None

  def __init__(self, cfg: RunConfig, params, version: int, log_fn=print):
    self.dir = weights_dir(cfg)

    def recover():   # across processes, process 0 owns the files (`processes.publish_weights`)
      withdrawn = weight_files.recover(self.dir, version)
      if withdrawn:
        log_fn(f"withdrew weights v{withdrawn} published after the checkpoint at step {version}: those steps are "
               "redone")
    processes.on_primary("recover_weights", recover)
    processes.publish_weights(self.dir, params, version, unless_latest=True)

  def publish(self, params, version: int) -> float:
    t0 = time.perf_counter()
    processes.publish_weights(self.dir, params, version)
    return time.perf_counter() - t0

  def close(self) -> None:
    pass

  @staticmethod
  def follow(cfg: RunConfig) -> Follower:
    """A JaxEngine on the newest published weights (waits for the first), reloading newer ones when asked."""
    wdir = weights_dir(cfg)
    while weight_files.latest(wdir) is None:
      time.sleep(0.2)
    like = jax.eval_shape(lambda: model.init(jax.random.key(0), cfg.model))
    version, path = weight_files.latest(wdir)
    # Committed to one device from the start, as `update_weights` places later versions: no recompile on update.
    engine = _rollout_engine(cfg, jax.device_put(weight_files.load(path, like), jax.devices()[0]), version,
                             f"worker-{os.getpid()}", print if cfg.rollout.draft_tokens else None)
    return Follower(engine, lambda: engine.policy_version, follow_pointer(wdir, like, engine))


def follow_pointer(wdir: str, like, engine) -> Callable[[], None]:
  """A worker's `load_newer` for weight files: loads the version `latest.json` names whenever it differs from the
  engine's — newer, or older after a restarted trainer withdrew versions it had published (`weight_files.recover`)."""

  def load() -> None:
    while (got := weight_files.latest(wdir)) is not None and got[0] != engine.policy_version:
      try:
        engine.update_weights(jax.device_put(weight_files.load(got[1], like)), policy_version=got[0])
      except FileNotFoundError:
        continue   # pruned or withdrawn between the pointer read and the load: the pointer has moved on

  return load


PUBLISHERS: dict[str, type] = {"in_place": InPlace, "files": WeightFiles, "fleet": fleet.FleetPublisher}


def publisher_name(cfg: RunConfig) -> str:
  return ENGINES[cfg.rollout.engine][cfg.rollout.mode]   # RolloutConfig checked both names


def publisher_class(name: str) -> type:
  if name not in PUBLISHERS:
    raise ValueError(f"unknown publisher {name!r}; valid: {sorted(PUBLISHERS)}")
  return PUBLISHERS[name]


def make(cfg: RunConfig, params, version: int, log_fn=print) -> Publisher:
  """The run's publisher, started on `params` as `version` (an SGLang fleet starts its servers here)."""
  return publisher_class(publisher_name(cfg))(cfg, params, version, log_fn)


def follow(cfg: RunConfig) -> Follower:
  """The worker-process end of the run's publisher."""
  return publisher_class(publisher_name(cfg)).follow(cfg)
