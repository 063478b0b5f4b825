"""Builds the device mesh with the four physical axes the sharding rules refer to."""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "expert", "context", "tensor")


def make_mesh(axis_sizes: dict[str, int] | None = None, devices=None) -> Mesh:
  """Returns a mesh over `devices` with axes (data, expert, context, tensor).

  Args:
    axis_sizes: size per axis name; missing axes get size 1. `{"data": -1}` (one axis at -1) takes the
      remaining devices. Default: all devices on `data`.
    devices: the devices to use (default `jax.devices()`).

  Returns:
    A `Mesh` with `AxisType.Auto` axes, so jitted code may take unsharded inputs (FACTS.md: `jax.make_mesh`'s
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
