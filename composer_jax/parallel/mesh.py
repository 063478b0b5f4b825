"""Builds the device mesh with the four physical axes the sharding rules refer to, from sizes or a `MeshConfig`."""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from composer_jax.parallel.rules import ShardingRules

MESH_AXES = ("data", "expert", "context", "tensor")


def make_mesh(axis_sizes: dict[str, int] | None = None, devices=None) -> Mesh:
  """Returns a mesh over `devices` with axes (data, expert, context, tensor).

  Args:
    axis_sizes: size per axis name; missing axes get size 1. `{"data": -1}` (one axis at -1) takes the
      remaining devices. Default: all devices on `data`.
    devices: the devices to use (default `jax.devices()`).

  Returns:
    A `Mesh` with `AxisType.Auto` axes, so jitted code may take unsharded inputs (`jax.make_mesh`'s
    default `Explicit` axes demand pre-sharded inputs).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = dict(axis_sizes or {"data": -1})
  unknown = sorted(set(sizes) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"Unknown mesh axis name(s) {unknown}; valid names: {list(MESH_AXES)}")
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"At most one mesh axis may be -1, got {free}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if len(devices) % fixed:
      raise ValueError(f"{len(devices)} devices are not divisible by the fixed axis sizes {sizes}")
    sizes[free[0]] = len(devices) // fixed
  shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
  if math.prod(shape) != len(devices):
    raise ValueError(f"Mesh shape {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices, "
                     f"but {len(devices)} were given")
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes (one may be -1: the remaining devices) and whether weights are FSDP-sharded over `data`.

  With no -1 axis and fewer devices than the machine has, a single-process run uses the first devices (e.g. the
  1-device CPU default); a multi-process run must cover every device.
  """
  data: int = 1
  expert: int = 1
  context: int = 1
  tensor: int = 1
  fsdp: bool = True   # weights' `embed` dim sharded over `data` (ZeRO-3 style); False replicates it
  zero1: bool = False  # optimizer moments split over `data` (ZeRO-1): with fsdp=False, weights stay replicated

  def __post_init__(self):
    sizes = self.axis_sizes()
    bad = {a: s for a, s in sizes.items() if s != -1 and s < 1}
    if bad:
      raise ValueError(f"Mesh axis sizes must be positive or -1, got {bad}")
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
      raise ValueError(f"At most one mesh axis may be -1, got {free}")

  def axis_sizes(self) -> dict[str, int]:
    return {a: getattr(self, a) for a in MESH_AXES}

  def rules(self, base: ShardingRules | None = None) -> ShardingRules:
    """`base` (default `ShardingRules()`) with `embed` on `data` iff FSDP is on, moments on `data` iff ZeRO-1."""
    base = ShardingRules() if base is None else base
    return dataclasses.replace(base, embed="data" if self.fsdp else None,
                               optimizer_state="data" if self.zero1 else base.optimizer_state)


def mesh_from_config(cfg: MeshConfig, devices=None) -> Mesh:
  """The mesh `cfg` describes over `devices` (default: all devices of all processes)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = cfg.axis_sizes()
  if -1 not in sizes.values():
    needed = math.prod(sizes.values())
    if needed > len(devices):
      raise ValueError(f"Mesh {sizes} needs {needed} devices, but only {len(devices)} exist")
    if needed < len(devices) and jax.process_count() > 1:
      raise ValueError(f"Mesh {sizes} uses {needed} of {len(devices)} devices; a multi-process run must use all "
                       "of them (set one axis to -1)")
    devices = devices[:needed]
  return make_mesh(sizes, devices)
