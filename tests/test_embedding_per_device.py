"""The embedding lookup per device on 8 fake CPU devices (model/embedding.py) against the one-device lookup: values
and the table's gradient, and the collectives its backward compiles to (the gradient reduce-scattered over the
table's FSDP axes, then only that shard summed over the other token axes)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import hlo_collectives as hc
from composer_jax.model import embedding
from composer_jax.parallel import make_mesh
from composer_jax.parallel.rules import ShardingRules, use_rules

B, L, V, D = 4, 16, 96, 32
AXES = {"data": 2, "expert": 2, "context": 2}
# Rows over data x expert, positions over context; the table's D over context (FSDP), as the plan's 256-device mesh.
RULES = ShardingRules(batch=("data", "expert"), embed="context")


def _loss(table, ids, wts):
  # Repeated ids (V < B x L) make the backward's scatter-add sum rows from several tokens and devices.
  return jnp.sum(embedding.lookup(table, ids) * wts)


def _inputs():
  ks = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(ks[0], (V, D), jnp.float32), jax.random.randint(ks[1], (B, L), 0, V),
          jax.random.normal(ks[2], (B, L, D), jnp.float32))


def _on_mesh():
  mesh = make_mesh(AXES)
  table, ids, wts = _inputs()
  table = jax.device_put(table, NamedSharding(mesh, P(None, "context")))
  ids = jax.device_put(ids, NamedSharding(mesh, P(("data", "expert"), "context")))
  wts = jax.device_put(wts, NamedSharding(mesh, P(("data", "expert"), "context", None)))
  fn = jax.jit(jax.value_and_grad(_loss))
  with jax.set_mesh(mesh), use_rules(RULES):
    return fn(table, ids, wts), jax.jit(embedding.lookup)(table, ids), fn.lower(table, ids, wts).compile().as_text()


def test_per_device_lookup_matches_one_device():
  table, ids, wts = _inputs()
  loss1, g1 = jax.jit(jax.value_and_grad(_loss))(table, ids, wts)
  (loss8, g8), rows8, _ = _on_mesh()
  np.testing.assert_array_equal(np.asarray(rows8), np.asarray(table)[np.asarray(ids)])
  np.testing.assert_allclose(loss8, loss1, rtol=1e-6)
  np.testing.assert_allclose(g8, g1, rtol=1e-6, atol=1e-6)     # sums of the same f32 terms in another order


def test_the_gradient_is_reduce_scattered_before_it_is_summed():
  """Backward: one reduce-scatter of the full [V, D] gradient over `context` (2), then an all-reduce over
  data x expert (4) of the half it leaves, not of the full gradient."""
  _, _, text = _on_mesh()
  region = [c for c in hc.parse(text, 8) if "embedding" in c.op_name]
  rs = [c for c in region if c.kind == "reduce-scatter"]
  ar = [c for c in region if c.kind == "all-reduce"]
  assert len(rs) == 1 and rs[0].group_size == 2 and rs[0].buffer_bytes == V * D * 4
  # XLA combines the loss's own f32 scalar sum into the same all-reduce: + 4 bytes.
  assert len(ar) == 1 and ar[0].group_size == 4 and ar[0].buffer_bytes == V * D * 4 // 2 + 4
