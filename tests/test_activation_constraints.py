"""Activation sharding constraints (`parallel.rules.constrain`) on 8 fake CPU devices: the model's values and
gradients equal the one-device run, and the router's top-k runs on each device's own tokens."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import hlo_collectives as hc
from composer_jax import model
from composer_jax.model import ModelConfig
from composer_jax.parallel import make_mesh
from composer_jax.parallel.rules import ShardingRules, constrain, use_rules

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                  n_group=4, topk_group=2, first_k_dense_replace=1, moe_impl="dense")
AXES = {"data": 4, "tensor": 2}
RULES = ShardingRules(batch="data", embed="data")


def _loss(params, tokens):
  h, aux = model.hidden_states(params, tokens, CFG)
  return jnp.mean(h.astype(jnp.float32) ** 2) + jnp.mean(aux["router_scores"]), aux["experts"]


def test_constrain_is_the_identity_without_a_mesh_and_leaves_manual_axes_out():
  x = jnp.ones((4, 8, 2))
  assert constrain(x, ("batch", "seq", None)) is x
  mesh = make_mesh({"data": 8})
  f = jax.shard_map(lambda y: constrain(y, ("batch", None, None)) * 2, mesh=mesh, in_specs=P("data"),
                    out_specs=P("data"))
  with jax.set_mesh(mesh):
    np.testing.assert_array_equal(jax.jit(f)(jnp.ones((8, 8, 2))), 2.0)


def test_constrained_model_matches_one_device_and_top_k_stays_local():
  tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, CFG.vocab_size)
  params = model.init(jax.random.key(0), CFG)
  fn = jax.jit(jax.value_and_grad(_loss, has_aux=True))
  (ref, ref_experts), ref_g = fn(params, tokens)
  mesh = make_mesh(AXES)
  sharded = jax.device_put(params, model.shardings(CFG, mesh, RULES))
  tok = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh), use_rules(RULES):
    (got, experts), g = fn(sharded, tok)
    text = fn.lower(sharded, tok).compile().as_text()
  # f32; only summation orders differ (FSDP / tensor-parallel partial sums): 1e-5 relative to each leaf's scale.
  np.testing.assert_allclose(float(got), float(ref), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(experts), np.asarray(ref_experts))
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
  scores_global = 8 * 32 * CFG.n_routed_experts * 4
  gathered = [c for c in hc.parse(text, 8, program_dtypes=False) if c.kind == "all-gather" and "top_k" in c.op_name]
  assert not gathered, [(c.buffer_bytes, scores_global) for c in gathered]
