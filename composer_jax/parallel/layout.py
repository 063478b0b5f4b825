"""Where training data and weights live on a mesh: divisibility checks, batch shardings, per-process batch slices.

The trainer's batch is a dict of [B, L] host arrays. B goes on the mesh axes of the logical `batch` axis, L on those
of `seq`. In a multi-process run each process loads only the rows its devices hold (`process_batch_shard`) and
`global_batch` assembles the global array from those per-process slices. Letters: B batch rows, L sequence length.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from composer_jax import model
from composer_jax.model.config import ModelConfig
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


def check_model_params(model_cfg: ModelConfig, mesh: Mesh, rules: ShardingRules) -> None:
  """`check_params_divisible` for every param of `model_cfg` (`model.param_specs`)."""
  specs = jax.tree_util.tree_flatten_with_path(model.param_specs(model_cfg),
                                               is_leaf=lambda x: isinstance(x, model.ArrayInfo))[0]
  check_params_divisible(((jax.tree_util.keystr(k), v) for k, v in specs), mesh, rules)


def _axes_over(logical: str, mesh: Mesh, rules: ShardingRules) -> tuple[str, ...]:
  return tuple(a for a in rules.mesh_axes(logical) if a in mesh.axis_names and dict(mesh.shape)[a] > 1)


def _check(size: int, what: str, logical: str, mesh: Mesh, rules: ShardingRules, fix: str, factor: int = 1) -> None:
  axes = _axes_over(logical, mesh, rules)
  n = math.prod(dict(mesh.shape)[a] for a in axes) * factor
  if size % n:
    sizes = " x ".join(f"{a}={dict(mesh.shape)[a]}" for a in axes) + (f" x {factor}" if factor > 1 else "")
    raise ValueError(f"mesh axes {sizes} (= {n}) shard {what} but do not divide it ({size}): {fix}")


def check_mesh(model_cfg: ModelConfig, mesh: Mesh, rules: ShardingRules, rows: Sequence[int], length: int) -> None:
  """Raises one `ValueError` naming the mesh axis and the sizes when the mesh does not divide the model's experts
  or heads, a step's row count (each of `rows`: packed, and unpacked for a group that packs alone) or its
  `length`; then checks every param dimension (`check_model_params`)."""
  _check(model_cfg.n_routed_experts, "the model's experts (model.n_routed_experts)", "experts", mesh, rules,
         "change mesh.expert")
  _check(model_cfg.num_attention_heads, "the model's attention heads (model.num_attention_heads)", "heads", mesh,
         rules, "change mesh.tensor")
  for r in rows:
    _check(r, "a step's rows (rl.pack_rows, or rl.rows_per_step / rl.groups_per_step x rollout.samples_per_prompt)",
           "batch", mesh, rules, "change them or the mesh axes")
  # Ring and all-gather attention cut a sequence into 2 x context zig-zag chunks.
  zigzag = 2 if model_cfg.attention_impl in ("ring", "allgather") else 1
  _check(length, "a step's length (harness.context_budget)", "seq", mesh, rules, "change it or mesh.context",
         factor=zigzag)
  check_model_params(model_cfg, mesh, rules)


def batch_spec(mesh: Mesh, rules: ShardingRules) -> PartitionSpec:
  """PartitionSpec of a [B, L] batch array: B over the `batch` mesh axes, L over the `seq` ones (if in the mesh)."""
  return PartitionSpec(spec_entry(_axes_over("batch", mesh, rules)), spec_entry(_axes_over("seq", mesh, rules)))


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
