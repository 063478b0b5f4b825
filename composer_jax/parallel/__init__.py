"""Device mesh, logical-axis sharding rules, and the shard_map regions: expert.py (EP), ring.py / context.py (CP)."""
from composer_jax.parallel.mesh import MESH_AXES, MeshConfig, make_mesh, mesh_from_config
from composer_jax.parallel.rules import ShardingRules, logical_to_sharding, logical_to_spec

__all__ = ["MESH_AXES", "MeshConfig", "ShardingRules", "logical_to_sharding", "logical_to_spec", "make_mesh",
           "mesh_from_config"]
