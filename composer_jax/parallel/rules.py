"""Logical axis names → mesh axes: the one table an ablation edits.

Every param and activation names its dimensions with the logical names below; `logical_to_spec` turns such a
tuple into a `PartitionSpec`. A logical name mapped to None is replicated.

Model code reads the table in force with `current_rules()` at trace time (the per-device LM head, the EP region,
activation constraints), as it reads the mesh from `jax.set_mesh`; a trainer sets it with `use_rules(rules)` around
tracing (`train.step.make_train_step` does). Outside any `use_rules` it is `ShardingRules()`.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Maps each logical axis name to a mesh axis (or tuple of mesh axes, or None = replicated).

  The defaults are FSDP-on-`data` for weights' `embed` dim, tensor parallelism over heads/ffw/vocab, expert
  parallelism over `experts`, and batch over `data`; sequence (`seq`) goes on `context`.
  """
  # activations
  batch: MeshAxes = "data"
  seq: MeshAxes = "context"
  # weights
  embed: MeshAxes = "data"
  vocab: MeshAxes = "tensor"
  heads: MeshAxes = "tensor"
  head_dim: MeshAxes = None
  qk_rope: MeshAxes = None
  q_lora: MeshAxes = None
  q_lora_in: MeshAxes = None      # q_b's input dim (the q_lora latent again): FSDP can split it where it splits q_a's
                                  # `embed`, which would collide with q_a's own `q_lora`
  kv_lora: MeshAxes = None
  ffw: MeshAxes = "tensor"
  experts: MeshAxes = "expert"
  expert_ffw: MeshAxes = "tensor"
  expert_embed: MeshAxes = None   # the D dim of expert weights (experts already carry `expert`)
  shared_ffw: MeshAxes = "tensor"
  router_experts: MeshAxes = None  # router weight / bias: small, replicated
  layers: MeshAxes = None         # the stacked-layer axis scanned over
  mtp: MeshAxes = None            # the stacked MTP-module axis
  norm: MeshAxes = None           # RMSNorm scales
  concat_embed: MeshAxes = None   # the 2D input of MTP's eh_proj
  # optimizer state
  optimizer_state: MeshAxes = None  # extra mesh axes over which Adam's moments are split (ZeRO-1: "data"), on the
                                    # first dimension they divide that the param's own sharding leaves free

  def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
    """Returns the mesh axes one logical name maps to (empty tuple: replicated)."""
    if logical is None:
      return ()
    names = {f.name for f in dataclasses.fields(self)}
    if logical not in names:
      raise ValueError(f"Unknown logical axis {logical!r}; ShardingRules knows {sorted(names)}")
    m = getattr(self, logical)
    if m is None:
      return ()
    return (m,) if isinstance(m, str) else tuple(m)


def spec_entry(axes: tuple[str, ...]):
  """A PartitionSpec entry for a dimension split over `axes`: None, one axis name, or the tuple."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


def logical_to_spec(logical_axes: tuple[str | None, ...], rules: ShardingRules) -> PartitionSpec:
  """Turns logical axis names into a PartitionSpec, refusing two dims on one mesh axis.

  Args:
    logical_axes: one logical name (or None) per array dimension.
    rules: the table.

  Returns:
    The PartitionSpec.

  Raises:
    ValueError: if two dimensions of the array map to the same mesh axis (naming both logical axes).
  """
  used: dict[str, str] = {}
  spec = []
  for name in logical_axes:
    axes = rules.mesh_axes(name)
    for a in axes:
      if a in used:
        raise ValueError(f"Logical axes {used[a]!r} and {name!r} of one array {tuple(logical_axes)} both map to "
                         f"mesh axis {a!r}; change ShardingRules so they differ")
      used[a] = name
    spec.append(spec_entry(axes))
  return PartitionSpec(*spec)


def logical_to_sharding(logical_axes: tuple[str | None, ...], mesh: Mesh, rules: ShardingRules,
                        shape: tuple[int, ...] | None = None) -> NamedSharding:
  """NamedSharding for `logical_axes` on `mesh`; with `shape`, dims a mesh axis does not divide are replicated."""
  spec = logical_to_spec(logical_axes, rules)
  if shape is not None:
    fixed = []
    for dim, s in zip(shape, spec):
      axes = () if s is None else (s,) if isinstance(s, str) else s
      n = 1
      for a in axes:
        n *= mesh.shape[a]
      fixed.append(s if dim % n == 0 else None)
    spec = PartitionSpec(*fixed)
  return NamedSharding(mesh, spec)


_CURRENT: contextvars.ContextVar[ShardingRules | None] = contextvars.ContextVar("sharding_rules", default=None)


def current_rules() -> ShardingRules:
  """The table set by the innermost `use_rules`, else `ShardingRules()`."""
  rules = _CURRENT.get()
  return ShardingRules() if rules is None else rules


@contextlib.contextmanager
def use_rules(rules: ShardingRules):
  """Makes `rules` the table model code sees while tracing inside this block."""
  token = _CURRENT.set(rules)
  try:
    yield rules
  finally:
    _CURRENT.reset(token)


def mesh_axes_dividing(logical: str | None, size: int, mesh, rules: ShardingRules) -> tuple[str, ...]:
  """The mesh axes `logical` maps to that are in `mesh` with size > 1, kept in order while their product divides
  `size` (an axis that would not divide is left out: that dimension is then replicated over it)."""
  out, n = [], 1
  for a in rules.mesh_axes(logical):
    k = dict(mesh.shape).get(a, 1)
    if k > 1 and size % (n * k) == 0:
      out.append(a)
      n *= k
  return tuple(out)


TOKENS = ("batch", "seq", None)   # logical layout of [B, L, ...] activations between ops


def constrain(x, logical_axes: tuple[str | None, ...]):
  """`with_sharding_constraint` of an activation to its logical layout under the rules in force, on the mesh set
  with `jax.set_mesh`; the identity without a mesh. Mesh axes that are manual here (inside a `shard_map`) or that
  do not divide a dimension are left out of it.

  Why: without constraints the partitioner picks activation layouts by propagation, and chose badly at a few
  points (it replicated the embedding lookup's output to re-shard it, and all-gathered every token's router scores
  to every device for `lax.top_k`); pinning tokens to the batch/seq layout there keeps each op on its own tokens.
  """
  import jax
  from jax.sharding import AxisType

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  rules = current_rules()
  auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
  used: set[str] = set()
  spec = []
  for size, name in zip(x.shape, logical_axes):
    axes = tuple(a for a in mesh_axes_dividing(name, size, mesh, rules) if a in auto and a not in used)
    used.update(axes)
    spec.append(spec_entry(axes))
  if not used:
    return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))
