"""Multi-process (multi-host) start-up: `jax.distributed.initialize` from flags or the environment.

Every process runs the same program; after `initialize`, `jax.devices()` lists the devices of all processes and a
mesh over them spans hosts. Call `initialize` before anything touches a device.
"""
from __future__ import annotations

import dataclasses
import os

import jax

CPU_COLLECTIVES = ("gloo", "mpi", "none")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins a multi-process run.

  Attributes:
    coordinator_address: "host:port" of process 0's coordination service ("" = single process unless `auto`).
    num_processes: total processes.
    process_id: this process's rank in [0, num_processes).
    local_device_ids: the devices this process drives (None = all visible ones).
    auto: let `jax.distributed.initialize()` read the cluster (SLURM, Open MPI, Cloud TPU, Kubernetes).
    cpu_collectives: cross-process collectives for the CPU backend ("gloo" works out of the box).
  """
  coordinator_address: str = ""
  num_processes: int = 1
  process_id: int = 0
  local_device_ids: tuple[int, ...] | None = None
  auto: bool = False
  cpu_collectives: str = "gloo"

  def __post_init__(self):
    if self.cpu_collectives not in CPU_COLLECTIVES:
      raise ValueError(f"cpu_collectives={self.cpu_collectives!r}; valid: {CPU_COLLECTIVES}")
    if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})")
    if self.num_processes > 1 and not self.coordinator_address and not self.auto:
      raise ValueError(f"num_processes={self.num_processes} needs a coordinator_address (host:port of process 0)")

  @property
  def enabled(self) -> bool:
    return self.auto or self.num_processes > 1

  @classmethod
  def from_env(cls, **overrides) -> DistributedConfig:
    """Fields from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, then `overrides` (if not None)."""
    env = os.environ
    fields = dict(coordinator_address=env.get("JAX_COORDINATOR_ADDRESS", ""),
                  num_processes=int(env.get("JAX_NUM_PROCESSES", "1")), process_id=int(env.get("JAX_PROCESS_ID", "0")))
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**fields)


def initialize(cfg: DistributedConfig) -> None:
  """Joins the run `cfg` describes (a no-op for a single process)."""
  if not cfg.enabled:
    return
  if cfg.cpu_collectives != "none":
    # Without it, XLA:CPU computations that span processes fail at run time (no cross-process collectives).
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
  if cfg.auto:
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes, process_id=cfg.process_id,
                               local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids else None)


def is_primary() -> bool:
  """True on the one process that writes logs and metrics (process 0)."""
  return jax.process_index() == 0


def barrier(name: str, timeout_s: int = 3600) -> None:
  """Waits until every process reaches `name` (no-op for one process).

  It waits in the coordination service, not in a device collective: XLA:CPU's gloo collectives give a late peer only
  30 s, far less than one process may spend training the tokenizer or compiling.
  """
  if jax.process_count() > 1:
    import orbax.checkpoint as ocp
    ocp.multihost.get_barrier_sync_fn()(key=name, timeout_ms=timeout_s * 1000)
