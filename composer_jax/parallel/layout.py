"""Where training data and weights live on a mesh: divisibility checks, batch shardings, per-process batch slices.

The trainer's batch is a dict of [B, L] host arrays. B goes on the mesh axes of the logical `batch` axis, L on those
of `seq`. In a multi-process run each process loads only the rows its devices hold (`process_batch_shard`) and
`global_batch` assembles the global array from those per-process slices. Letters: B batch rows, L sequence length.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from composer_jax.parallel.rules import ShardingRules, logical_to_spec, spec_entry


def _spec_axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_divisible(name: str, shape: tuple[int, ...], logical_axes: tuple[str | None, ...], mesh: Mesh,
                    rules: ShardingRules) -> None:
  """Raises if a mesh axis (or product of axes) that shards a dimension does not divide it, naming both."""
  spec = logical_to_spec(logical_axes, rules)
  for dim, (size, logical, entry) in enumerate(zip(shape, logical_axes, spec)):
    axes = _spec_axes(entry)
    n = math.prod(mesh.shape[a] for a in axes)
    if size % n:
      sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
      raise ValueError(f"{name}: dimension {dim} ({logical!r}, size {size}) is sharded over mesh axes {sizes} "
                       f"(= {n}), which does not divide it; change the mesh or ShardingRules.{logical}")


def check_params_divisible(named_infos: Iterable[tuple[str, object]], mesh: Mesh, rules: ShardingRules) -> None:
  """`check_divisible` for every (name, info) where info has `.shape` and `.logical_axes` (model ArrayInfos)."""
  for name, info in named_infos:
    check_divisible(f"param {name}", info.shape, info.logical_axes, mesh, rules)


def batch_spec(mesh: Mesh, rules: ShardingRules) -> PartitionSpec:
  """PartitionSpec of a [B, L] batch array: B over the `batch` mesh axes, L over the `seq` ones (if in the mesh)."""
  def present(logical):
    axes = tuple(a for a in rules.mesh_axes(logical) if a in mesh.axis_names and mesh.shape[a] > 1)
    return spec_entry(axes)
  return PartitionSpec(present("batch"), present("seq"))


def batch_sharding(mesh: Mesh, rules: ShardingRules) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(mesh, rules))


def check_batch_shape(batch_size: int, seq_len: int, sharding: NamedSharding) -> None:
  """Raises naming the batch/sequence size and the mesh axes when they do not divide."""
  b, l = sharding.spec
  for what, size, entry in (("global batch size", batch_size, b), ("sequence length", seq_len, l)):
    axes = _spec_axes(entry)
    n = math.prod(sharding.mesh.shape[a] for a in axes)
    if size % n:
      sizes = " x ".join(f"{a}={sharding.mesh.shape[a]}" for a in axes)
      raise ValueError(f"The {what} {size} is not divisible by mesh axes {sizes} (= {n}) that shard it")


def process_batch_shard(sharding: NamedSharding, process_index: int | None = None) -> tuple[int, int]:
  """(shard_index, shard_count): which contiguous block of the global batch rows this process's devices hold.

  Processes whose devices hold the same rows (batch replicated across them) get the same index and must load the
  same rows. Raises if a process's rows are not one contiguous block of equal size (an unusual device order).
  """
  process_index = jax.process_index() if process_index is None else process_index
  mesh = sharding.mesh
  axes = _spec_axes(sharding.spec[0])
  n_blocks = math.prod(mesh.shape[a] for a in axes)
  # Row block (in units of 1/n_blocks of the batch) of every device, as PartitionSpec orders a tuple of axes.
  ids = np.zeros(mesh.devices.shape, np.int64)
  for a in axes:
    i = mesh.axis_names.index(a)
    coord = np.arange(mesh.shape[a]).reshape([-1 if j == i else 1 for j in range(mesh.devices.ndim)])
    ids = ids * mesh.shape[a] + coord
  rows: dict[int, set[int]] = {}
  for dev, block in zip(mesh.devices.flat, ids.flat):
    rows.setdefault(dev.process_index, set()).add(int(block))
  groups = sorted({tuple(sorted(r)) for r in rows.values()})
  size = len(groups[0])
  for g in groups:
    if len(g) != size or g != tuple(range(g[0], g[0] + size)) or g[0] % size:
      raise ValueError(f"Processes hold batch row blocks {groups} (of {n_blocks}); each must hold one contiguous, "
                       "equal block: order the mesh so the batch axes are outermost")
  if len(groups) * size != n_blocks:
    raise ValueError(f"Processes' batch row blocks {groups} overlap; cannot split the batch between processes")
  return groups.index(tuple(sorted(rows[process_index]))), len(groups)


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding, shard_count: int) -> dict[str, jax.Array]:
  """Global [B, L] arrays from this process's [B / shard_count, L] rows (a plain device_put in one process)."""
  out = {}
  for k, v in local.items():
    v = np.asarray(v)
    out[k] = jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * shard_count, *v.shape[1:]))
  return out
