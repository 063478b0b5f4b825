"""Where the embedded engine's weights and request rows live on a mesh (`JaxEngine(..., mesh=, placement=)`).

  trainer    the weights as the trainer holds them (its shardings: FSDP, experts over `expert`, ...); the request
             rows follow from them. No extra memory, and a weight update between the trainer's state and the engine
             is no copy at all (the same arrays).
  replicas   a whole copy of the weights on every device of the mesh (one all-gather per update, device to device)
             and the request rows split over all its devices: one engine replica per device, each decoding its rows
             with no collective inside the decode loop.

Either way the engine returns what one device returns: the same tokens for the same seeds, the logprobs and routing
the trainer computes (`tests/test_sampling_mesh.py`). Without a mesh the engine runs where its weights are.
"""
from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PLACEMENTS = ("trainer", "replicas")   # also the values of `rollout.engine_placement` (rl/config.py)


def check(placement: str) -> None:
  if placement not in PLACEMENTS:
    raise ValueError(f"engine placement {placement!r}; valid: {list(PLACEMENTS)}")


def weights(params, mesh: Mesh | None, placement: str):
  """`params` where `placement` keeps them on `mesh`: as given ('trainer'), or replicated on every device."""
  if mesh is None or placement == "trainer":
    return params
  return jax.device_put(params, NamedSharding(mesh, P()))


def rows(tree, mesh: Mesh | None, placement: str):
  """A call's per-row inputs (leading dim: rows or unique prompts) split over every device of the mesh for
  'replicas' when the mesh divides them; otherwise left for the program to place (they are small)."""
  if mesh is None or placement == "trainer":
    return tree

  def put(x):
    if x.ndim == 0 or x.shape[0] % mesh.size:
      return x
    return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))
  return jax.tree.map(put, tree)
