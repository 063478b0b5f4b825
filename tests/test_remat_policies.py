"""Named remat policies (`ModelConfig.remat_policy`, model/remat.py `REMAT_POLICIES`): same values and
gradients as no remat, the memory order they exist for (full < save_dots < no remat), under `lax.scan`, and (8 fake
devices) the exchanges the saving policies spare the backward."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import hlo_collectives
from composer_jax import model
from composer_jax.model import ModelConfig, remat
from composer_jax.parallel import make_mesh
from composer_jax.parallel.rules import ShardingRules, use_rules

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=5, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_impl="dense", scan_layers=True)


def _loss(params, tokens, cfg):
  h, _ = model.hidden_states(params, tokens, cfg)
  return jnp.mean(h ** 2)


def test_policies_match_no_remat_and_order_memory():
  tokens = jax.random.randint(jax.random.key(1), (4, 256), 0, CFG.vocab_size)
  params = model.init(jax.random.key(0), CFG)
  grad = jax.jit(jax.value_and_grad(_loss), static_argnums=2)
  ref, ref_g = grad(params, tokens, CFG)
  temp = {None: grad.lower(params, tokens, CFG).compile().memory_analysis().temp_size_in_bytes}
  for policy in ("full", "save_dots"):
    cfg = dataclasses.replace(CFG, remat=True, remat_policy=policy)
    val, g = grad(params, tokens, cfg)
    # Recomputation repeats the same f32 ops: equal up to fusion-order rounding.
    np.testing.assert_allclose(float(val), float(ref), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
    temp[policy] = grad.lower(params, tokens, cfg).compile().memory_analysis().temp_size_in_bytes
  # Measured here: 21.6 / 30.2 / 50.1 MB.
  assert temp["full"] < temp["save_dots"] < temp[None], temp


def test_unknown_policy_lists_the_valid_names():
  cfg = dataclasses.replace(CFG, remat=True, remat_policy="offload_everything")
  tokens = jnp.zeros((1, 8), jnp.int32)
  names = "'full', 'offload_layer_input', 'save_attention', 'save_attention_ep_return', 'save_dots'"
  with pytest.raises(ValueError, match=f"valid: \\[{names}\\]"):
    jax.eval_shape(lambda p: _loss(p, tokens, cfg), model.abstract_params(cfg))


def _grad_and_exchanges(cfg, params, tokens, mesh, rules):
  """(loss, grads, {ring forward ppermutes, EP all-to-alls} per step) of the compiled value-and-grad."""
  grad = jax.jit(jax.value_and_grad(_loss), static_argnums=2)
  with jax.set_mesh(mesh), use_rules(rules):
    compiled = grad.lower(params, tokens, cfg).compile()
    val, g = compiled(params, tokens)
  colls = hlo_collectives.parse(compiled.as_text(), n_devices=mesh.size)
  count = lambda kind, scope: sum(c.times for c in colls if c.kind == kind and scope in c.op_name)  # noqa: E731
  return val, g, {"ring_fwd": count("collective-permute", "ring_attention_fwd"),
                  "ep": count("all-to-all", "ep_capacity")}


@pytest.mark.slow   # four policies compiled on context x expert; their values on one device: the test above
def test_saving_policies_spare_the_ring_and_the_return_exchange():
  """context=4 x expert=2, ring attention and capacity EP (nothing dropped at capacity E/K): "save_attention" and
  "save_attention_ep_return" equal no remat, values and gradients; under "full" the backward runs each layer's
  forward ring again (2x its ppermutes) and all 6 exchanges (dispatch, return, each forward, rematerialised and
  transposed); saving the ring's output halves the ring's, saving the return exchange's result leaves 5 of 6."""
  cfg = dataclasses.replace(CFG, num_hidden_layers=3, attention_impl="ring", ring_block=8, moe_impl="ep_capacity",
                            capacity_factor=2.0)
  mesh, rules = make_mesh({"expert": 2, "context": 4}), ShardingRules(batch=("data", "expert"))
  params = jax.device_put(model.init(jax.random.key(0), cfg), model.shardings(cfg, mesh, rules))
  tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.vocab_size)
  ref, ref_g, _ = _grad_and_exchanges(cfg, params, tokens, mesh, rules)
  n = {}
  for policy in ("full", "save_attention", "save_attention_ep_return"):
    val, g, n[policy] = _grad_and_exchanges(dataclasses.replace(cfg, remat=True, remat_policy=policy), params,
                                            tokens, mesh, rules)
    np.testing.assert_allclose(float(val), float(ref), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
  assert n["full"]["ring_fwd"] == 2 * n["save_attention"]["ring_fwd"] == 2 * n["save_attention_ep_return"]["ring_fwd"]
  assert n["full"]["ep"] == n["save_attention"]["ep"] > 0, n
  assert 5 * n["full"]["ep"] == 6 * n["save_attention_ep_return"]["ep"], n


def test_offloading_the_layer_input_is_refused_where_host_memory_is_device_memory():
  cfg = dataclasses.replace(CFG, remat=True, remat_policy="offload_layer_input")
  tokens = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="'cpu' does not have apart from its device memory"):
    jax.eval_shape(lambda p: _loss(p, tokens, cfg), model.abstract_params(cfg))


def test_offloading_the_layer_input_lowers_for_cuda_under_scan(monkeypatch):
  """Lowered for cuda (as a GPU would compile it; XLA:CPU cannot compile it): in each scanned stack the forward's
  body moves its layer input to pinned host memory and the backward's body moves it back, once per layer."""
  monkeypatch.setitem(remat.REMAT_POLICIES, "offload_layer_input", lambda: remat.offload_layer_input("cuda"))
  cfg = dataclasses.replace(CFG, remat=True, remat_policy="offload_layer_input")
  grad = jax.jit(jax.grad(_loss), static_argnums=2)
  text = grad.trace(model.abstract_params(cfg), jax.ShapeDtypeStruct((2, 64), jnp.int32), cfg).lower(
      lowering_platforms=("cuda",)).as_text()
  stacks = 2   # the dense stack (first_k_dense_replace = 1) and the MoE stack
  to_host = text.count('_xla_buffer_placement = "pinned_host"')
  to_device = text.count('_xla_buffer_placement = "device"')
  assert text.count("stablehlo.while") >= 2 * stacks and to_host == to_device == stacks, (to_host, to_device)
