"""Device mesh and logical-axis sharding rules (expert/context parallel regions come in a later issue)."""
from composer_jax.parallel.mesh import MESH_AXES, make_mesh
from composer_jax.parallel.rules import ShardingRules, logical_to_sharding, logical_to_spec

__all__ = ["MESH_AXES", "ShardingRules", "logical_to_sharding", "logical_to_spec", "make_mesh"]
