"""The embedding lookup: `table[ids]`, on a mesh per device (`per_device.py`).

Why per device: with the table's D split over the token axes (FSDP over `context`), the partitioner's lookup
scattered the backward into a full [V, D] float32 gradient per device and all-reduced it across every token axis,
over InfiniBand on a multi-node mesh (~5 GB per step on the 256-device Kimi K2 plan). In the region each device
looks up its own tokens in the gathered table; the gradient (a scatter-add in the table's dtype) is reduce-scattered
over the split axes and only that shard is summed over the other token axes.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from composer_jax.model import per_device
from composer_jax.parallel.rules import current_rules


def lookup(table_VxD: jax.Array, ids_BxL: jax.Array) -> jax.Array:
  """Rows of the table [V, D] (logical ("vocab", "embed")) for int ids [B, L]: [B, L, D] in the table's dtype."""
  mesh = per_device.active_mesh()
  if mesh is None:
    return table_VxD[ids_BxL]
  tok, t_spec, gathers, rest = per_device.region_layout(*ids_BxL.shape, table_VxD.shape, ("vocab", "embed"), mesh,
                                                        current_rules())

  def body(table_vxd, ids_bxl):
    return per_device.gather(table_vxd, gathers, rest)[ids_bxl]

  with jax.named_scope("embedding"):
    return jax.shard_map(body, mesh=mesh, in_specs=(t_spec, tok), out_specs=P(*tok, None))(table_VxD, ids_BxL)
