"""Ops on each device's own tokens: a `jax.shard_map` over the mesh axes the tokens are split on (the rules'
`batch` and `seq`), with the op's weights gathered inside. The LM head (`head.py`) and the embedding lookup
(`embedding.py`) run this way on a mesh.

Why: left to the partitioner, a weight sharded on `embed` (FSDP) made it run the head's every global chunk on every
device and all-reduce each chunk's logits, and made the embedding's backward all-reduce a full-size gradient across
nodes. In a region each device gathers the weight once (`gather`); the backward runs the transposed collectives in
the order that moves the fewest bytes: the weight is first marked varying over the token axes it is *not* split on
(`lax.pcast`, whose transpose sums over them), then all-gathered over those it is split on, so its gradient is
reduce-scattered over the split axes first and only that shard is summed over the others.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.rules import ShardingRules, mesh_axes_dividing, spec_entry


def active_mesh():
  """The mesh set with `jax.set_mesh`, or None when there is none or every axis has size 1 (run the plain op)."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or all(n == 1 for n in mesh.shape.values()) else mesh


def token_axes(B: int, L: int, mesh, rules: ShardingRules) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(mesh axes of the rows, of the positions): the rules' `batch` and `seq` axes that divide B and L."""
  b_axes = mesh_axes_dividing("batch", B, mesh, rules)
  return b_axes, tuple(a for a in mesh_axes_dividing("seq", L, mesh, rules) if a not in b_axes)


def weight_layout(shape: tuple[int, ...], logical: tuple[str | None, ...], tokens: tuple[str, ...], mesh,
                  rules: ShardingRules):
  """How a weight enters a token region: (its in_spec, [(dim, axes)] to all-gather inside, the other token axes).

  It keeps its own split over token axes (gathered inside, so its gradient is reduce-scattered there); over any
  other axis the partitioner gathers it at the region's boundary (every device there holds the same tokens, so that
  gradient is a local slice)."""
  used: list[str] = []
  gathers = []
  for dim, (size, name) in enumerate(zip(shape, logical)):
    axes = tuple(a for a in mesh_axes_dividing(name, size, mesh, rules) if a in tokens and a not in used)
    used += axes
    if axes:
      gathers.append((dim, axes))
  spec = P(*(spec_entry(dict(gathers).get(d, ())) for d in range(len(shape))))
  return spec, tuple(gathers), tuple(a for a in tokens if a not in used)


def region_layout(B: int, L: int, w_shape: tuple[int, ...], w_logical: tuple[str | None, ...], mesh,
                  rules: ShardingRules):
  """For a region over [B, L] tokens with one weight layout: (the tokens' spec, and `weight_layout`'s triple)."""
  b_axes, l_axes = token_axes(B, L, mesh, rules)
  return P(spec_entry(b_axes), spec_entry(l_axes)), *weight_layout(w_shape, w_logical, b_axes + l_axes, mesh, rules)


def gather(w: jax.Array, gathers, rest: tuple[str, ...]) -> jax.Array:
  """Inside the region: the whole weight (see the module docstring for the order)."""
  if rest:
    w = jax.lax.pcast(w, rest, to="varying")
  for dim, axes in gathers:
    w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
  return w
