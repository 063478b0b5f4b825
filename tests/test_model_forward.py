"""Forward-pass behaviour: layer scan, packing, router replay, MTP, sharded init."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from composer_jax.model import ModelConfig, RopeScaling, forward, init, shardings
from composer_jax.parallel import ShardingRules, logical_to_spec, make_mesh

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                  rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                                           mscale_all_dim=1.0),
                  num_nextn_predict_layers=1, moe_impl="ragged", seq_aux_loss_coef=0.01)


@functools.cache
def _params(cfg=CFG):
  return init(jax.random.key(0), cfg)


def _tokens(B=2, L=12, seed=1):
  return jax.random.randint(jax.random.key(seed), (B, L), 0, CFG.vocab_size)


@functools.partial(jax.jit, static_argnames=("cfg", "detach"))
def _fwd(params, tokens, cfg, segment_ids=None, positions=None, routing=None, detach=False):
  return forward(params, tokens, cfg, segment_ids=segment_ids, positions=positions, routing=routing,
                 mtp_detach_trunk=detach)


def test_output_shapes():
  ref, aux = _fwd(_params(), _tokens(), CFG)
  assert ref.shape == (2, 12, 64) and aux["mtp_logits"].shape == (1, 2, 12, 64)
  assert aux["router_scores"].shape == (1, 2, 12, 8) and aux["experts"].shape == (1, 2, 12, 2)
  assert aux["expert_load"].shape == (1, 8) and float(aux["expert_load"].sum()) == 2 * 12 * 2
  assert float(aux["balance_loss"]) > 0
  assert aux["mtp_expert_load"].shape == (1, 8) and float(aux["mtp_expert_load"].sum()) == 2 * 12 * 2


def test_layer_stacking_default_by_platform():
  from composer_jax.model.transformer import scans_layers
  assert scans_layers(CFG, "cpu") is False and scans_layers(CFG, "cuda") is True
  assert scans_layers(dataclasses.replace(CFG, scan_layers=True), "cpu") is True


def test_scan_loop_and_remat_agree():
  deep = dataclasses.replace(CFG, num_hidden_layers=3)  # a 2-layer MoE stack
  # Second MoE layer: the first one perturbed (saves compiling another init).
  params = dict(_params(), moe_layers=jax.tree.map(lambda a: jnp.concatenate([a, a * 0.9 + 0.01]),
                                                   _params()["moe_layers"]))
  tok = _tokens()
  ref, aux_ref = _fwd(params, tok, dataclasses.replace(deep, scan_layers=True))
  assert aux_ref["experts"].shape == (2, 2, 12, 2)
  out, aux = _fwd(params, tok, dataclasses.replace(deep, scan_layers=False))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(aux["experts"], aux_ref["experts"])


@pytest.mark.slow
def test_remat_gradients_equal():
  tok = _tokens()

  def grads(cfg):
    return jax.jit(jax.grad(lambda p: forward(p, tok, cfg)[0].std()))(_params())

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads(dataclasses.replace(CFG, remat=True)), grads(CFG))


def test_packed_row_equals_documents_alone():
  docs = _tokens(2, 6, seed=2)  # two 6-token documents, run alone (one per row) ...
  alone, aux_alone = _fwd(_params(), docs, CFG)
  # ... and packed into one 12-token row, with a 2-row batch whose second row is half padding (segment 0).
  packed = jnp.concatenate([docs.reshape(1, 12), jnp.concatenate([docs[:1], jnp.zeros_like(docs[:1])], 1)])
  seg = jnp.array([[1] * 6 + [2] * 6, [1] * 6 + [0] * 6])
  pos = jnp.array([list(range(6)) * 2, list(range(12))])
  out, aux = _fwd(_params(), packed, CFG, seg, pos)
  np.testing.assert_allclose(out[0, :6], alone[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[0, 6:], alone[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[1, :6], alone[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(aux["experts"][:, 0, 6:], aux_alone["experts"][:, 1])
  # Padding is not counted in the expert load: the packed batch holds doc 0 twice and doc 1 once.
  np.testing.assert_allclose(aux["expert_load"],
                             2 * _load(aux_alone["experts"][:, 0]) + _load(aux_alone["experts"][:, 1]))


def _load(experts_MxLxK):
  return jax.nn.one_hot(experts_MxLxK, CFG.n_routed_experts).sum((1, 2))


def test_router_replay_reproduces_and_trains_router():
  tok = _tokens()
  params = _params()
  ref, aux = _fwd(params, tok, CFG)
  out, aux2 = _fwd(params, tok, CFG, routing=aux["experts"])
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(aux2["experts"], aux["experts"])
  # A different routing changes the output (replay is really used).
  other = (aux["experts"] + 1) % CFG.n_routed_experts
  out3, aux3 = _fwd(params, tok, CFG, routing=other)
  np.testing.assert_array_equal(aux3["experts"], other)
  assert float(jnp.abs(out3 - ref).max()) > 1e-3

  def loss(p):  # under remat too, so the checkpointed path is exercised by a default test
    return forward(p, tok, dataclasses.replace(CFG, remat=True), routing=other)[0].mean()

  g = jax.jit(jax.grad(loss))(params)
  assert float(jnp.abs(g["moe_layers"]["moe"]["router"]).max()) > 0
  with pytest.raises(ValueError, match="routing has shape"):
    forward(params, tok, CFG, routing=aux["experts"][:, :1])


def test_mtp_targets_and_detach():
  # MTP module j at position t predicts token t+2+j: the targets are `shifted_targets(..., shift=j + 2)`.
  from composer_jax.train.losses import shifted_targets
  tok = jnp.arange(10)[None] + 1
  seg = jnp.array([[1] * 6 + [2] * 4])
  tgt0, mask0 = shifted_targets(tok, seg, jnp.ones_like(tok), 2)
  tgt1, mask1 = shifted_targets(tok, seg, jnp.ones_like(tok), 3)
  np.testing.assert_array_equal(tgt0[0, :8], tok[0, 2:])
  np.testing.assert_array_equal(tgt1[0, :7], tok[0, 3:])
  np.testing.assert_array_equal(mask0[0], [1, 1, 1, 1, 0, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(mask1[0], [1, 1, 1, 0, 0, 0, 1, 0, 0, 0])

  tok = _tokens()
  params = _params()

  def mtp_loss(p, detach):
    _, aux = forward(p, tok, CFG, mtp_detach_trunk=detach)
    return aux["mtp_logits"].std()

  for detach in (True, False):
    g = jax.jit(jax.grad(functools.partial(mtp_loss, detach=detach)))(params)
    trunk = [jnp.abs(x).max() for k in ("embed", "lm_head", "moe_layers", "dense_layers")
             for x in jax.tree.leaves(g[k])]
    mtp = [jnp.abs(x).max() for x in jax.tree.leaves(g["mtp"]["block"]["attn"])]
    assert min(float(m) for m in mtp) > 0
    if detach:
      assert max(float(t) for t in trunk) == 0.0
    else:
      assert float(jnp.abs(g["embed"]).max()) > 0 and float(jnp.abs(g["lm_head"]).max()) > 0
      assert float(jnp.abs(g["dense_layers"]["attn"]["kv_a"]).max()) > 0


def test_mtp_module_uses_next_token_embedding():
  """Module 0 at position t sees token t+1: changing only the last token changes MTP logits only at t >= L-2."""
  tok = _tokens()
  _, aux = _fwd(_params(), tok, CFG)
  _, aux2 = _fwd(_params(), tok.at[0, 11].set((tok[0, 11] + 1) % CFG.vocab_size), CFG)
  diff = np.abs(np.asarray(aux["mtp_logits"] - aux2["mtp_logits"])).max(-1)[0, 0]
  assert diff[10] > 1e-6 and diff[11] > 1e-6 and np.all(diff[:10] == 0)


def test_sharded_init_and_rules():
  mesh = make_mesh({"data": 2, "expert": 2, "tensor": 2})
  params = init(jax.random.key(0), CFG, mesh)
  w = params["moe_layers"]["moe"]["gate"]
  assert w.sharding.spec == P(None, "expert", None, "tensor")
  assert params["embed"].sharding.spec == P("tensor", "data")
  assert params["moe_layers"]["attn"]["q_b"].sharding.spec == P(None, None, "tensor", None)
  # Same values as the 1-device init.
  np.testing.assert_array_equal(np.asarray(w), np.asarray(_params()["moe_layers"]["moe"]["gate"]))
  assert jax.tree.structure(shardings(CFG, mesh)) == jax.tree.structure(params)
  with pytest.raises(ValueError, match="both map to mesh axis 'tensor'"):
    logical_to_spec(("heads", "ffw"), ShardingRules())
  with pytest.raises(ValueError, match="Unknown logical axis"):
    logical_to_spec(("heads", "nonsense"), ShardingRules())
  with pytest.raises(ValueError, match="needs 16 devices"):
    make_mesh({"data": 16})


def test_bf16_compute_runs_close_to_f32():
  cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
  tok = _tokens()
  out, _ = _fwd(_params(), tok, cfg)
  ref, _ = _fwd(_params(), tok, CFG)
  assert out.dtype == jnp.float32
  # bf16 has ~3 significant digits; logits are O(0.1-1).
  np.testing.assert_allclose(out, ref, atol=5e-2)
