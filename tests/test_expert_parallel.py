"""Expert parallelism (composer_jax/model/expert_parallel.py) on 8 fake CPU devices against the single-device paths."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_moe_paths import CFG, _loop_reference, _moe_params

from composer_jax import model
from composer_jax.model import ModelConfig
from composer_jax.model import expert_parallel as ep
from composer_jax.model import experts as experts_lib
from composer_jax.model import moe as moe_lib
from composer_jax.model.layers import mlp
from composer_jax.parallel import make_mesh
from composer_jax.parallel.rules import ShardingRules, use_rules

K = CFG.num_experts_per_tok
NO_DROP = CFG.n_routed_experts / K  # capacity factor E/K: C >= t per (source device, expert), nothing is dropped


def _routed(p, x_BxLxD, cfg=CFG):
  """Router outputs of the single-device code (idx, w as [B, L, K])."""
  B, L, D = x_BxLxD.shape
  s = moe_lib.router_scores(p, x_BxLxD.reshape(B * L, D))
  idx = moe_lib.select_experts(s, p["bias"], cfg)
  return idx.reshape(B, L, K), moe_lib.gate_weights(s, idx, cfg).reshape(B, L, K)


def _ep(p, x, idx, w, valid, cfg, mesh, **kw):
  with jax.set_mesh(mesh):
    return jax.jit(lambda *a: ep.expert_parallel(*a, cfg, **kw))(p, x, idx, w, valid)


@pytest.mark.parametrize("impl,axes", [
    ("ep_capacity", {"data": 2, "expert": 4}),
    ("ep_capacity", {"expert": 4, "tensor": 2}),  # each expert's F split over tensor: partial outputs psum'd
    ("ep_capacity", {"data": 8}),                  # expert axis of size 1: same code, no-op all-to-alls
    ("ep_capacity", {"data": 2, "context": 2, "expert": 2}),  # tokens also split over the sequence
    ("ep_ragged", {"data": 2, "expert": 4}),       # dropless, with the all_to_all-built reference collective
])
def test_ep_layer_matches_single_device(impl, axes):
  p = _moe_params(CFG)
  B, L = 8, 4
  x = jax.random.normal(jax.random.key(1), (B, L, CFG.hidden_size))
  idx, w = _routed(p, x)
  cfg = dataclasses.replace(CFG, moe_impl=impl, capacity_factor=NO_DROP)
  kw = {"ragged_all_to_all": ep.ragged_all_to_all_reference} if impl == "ep_ragged" else {}
  y, dropped = _ep(p, x, idx, w, jnp.ones((B, L), bool), cfg, make_mesh(axes), **kw)
  T, D = B * L, CFG.hidden_size
  dense = experts_lib.experts_dense(p, x.reshape(T, D), idx.reshape(T, K), w.reshape(T, K))
  cap, cap_dropped = experts_lib.experts_capacity(p, x.reshape(T, D), idx.reshape(T, K), w.reshape(T, K),
                                              jnp.ones(T, bool), NO_DROP)
  assert float(dropped) == 0.0 and float(cap_dropped) == 0.0
  # float32, the same per-row products on every path; only the order of the K-term (and, with tensor, the F-split)
  # sums differs: a few ulps of outputs of size ~2, measured <4e-7.
  np.testing.assert_allclose(np.asarray(y).reshape(T, D), dense, rtol=1e-6, atol=2e-6)
  np.testing.assert_allclose(np.asarray(y).reshape(T, D), cap, rtol=1e-6, atol=2e-6)
  # And both references against the per-expert float64 loop.
  ref, _ = _loop_reference(p, x.reshape(T, D), idx.reshape(T, K), w.reshape(T, K))
  np.testing.assert_allclose(np.asarray(y).reshape(T, D), ref, rtol=1e-4, atol=1e-4)


def test_fp8_dispatch_matches_compute_dtype_dispatch_within_e4m3_rounding():
  """ep_dispatch="fp8" on data=2 x expert=4: outputs within e4m3's rounding of the f32 exchange's, gradients
  (straight-through: the backward exchange is in f32) within the same bound, and the dispatch all-to-all carries
  f8 elements (the return stays f32)."""
  from benchmarks import hlo_collectives as hc
  p = _moe_params(CFG)
  B, L = 8, 4
  x = jax.random.normal(jax.random.key(1), (B, L, CFG.hidden_size))
  idx, w = _routed(p, x)
  mesh = make_mesh({"data": 2, "expert": 4})
  valid = jnp.ones((B, L), bool)
  r = jax.random.normal(jax.random.key(2), x.shape)       # a linear loss: dL/dy is the same on both paths

  def loss(p, x, cfg):
    y, _ = ep.expert_parallel(p, x, idx, w, valid, cfg)
    return jnp.sum(y * r), y
  out = {}
  for dispatch in ("compute", "fp8"):
    cfg = dataclasses.replace(CFG, moe_impl="ep_capacity", capacity_factor=NO_DROP, ep_dispatch=dispatch)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    with jax.set_mesh(mesh):
      out[dispatch] = fn(p, x, cfg), fn.lower(p, x, cfg).compile().as_text()
  ((_, y32), g32), _ = out["compute"]
  ((_, y8), g8), text = out["fp8"]
  # e4m3 keeps 3 mantissa bits: each input element within 2^-4 relative of its slot's scale; the expert FFN
  # (SwiGLU, sums over D) keeps the error at that order: 0.1 of the outputs' scale bounds it with margin.
  scale = float(jnp.abs(y32).max())
  np.testing.assert_allclose(np.asarray(y8), np.asarray(y32), atol=0.1 * scale)
  assert float(jnp.abs(y8 - y32).max()) > 0                       # the exchange really was quantised
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g32)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0.1 * float(jnp.abs(b).max()) + 1e-6)
  # Bytes in the program's types (XLA:CPU widens the f8 exchange to f16): the forward dispatch is 1 byte per value
  # plus one f32 scale per slot of D values; the return and the two backward exchanges stay f32.
  def a2a_bytes(t):
    return hc.summarize(hc.parse(t, 8))["all-to-all"]["buffer_bytes"]
  one_exchange = a2a_bytes(out["compute"][1]) // 4
  values = one_exchange // 4
  assert a2a_bytes(text) == values + 4 * values // CFG.hidden_size + 3 * one_exchange


def test_dispatch_round_trip_is_exact():
  """Tokens sent to their experts' devices and straight back (no expert compute) return bit for bit."""
  mesh = make_mesh({"data": 2, "expert": 4})
  B, L, D, E = 8, 4, CFG.hidden_size, CFG.n_routed_experts
  x = jax.random.normal(jax.random.key(2), (B, L, D))
  idx, _ = _routed(_moe_params(CFG), x)

  def body(x_bxlxD, idx_bxlxK):
    b, l, _ = x_bxlxD.shape
    t = b * l
    C = t  # capacity not exceeded
    recv_NxXxCxD, slot_m, keep_m = ep.dispatch(x_bxlxD.reshape(t, D), idx_bxlxK.reshape(-1),
                                               jnp.ones(t * K, bool), E, C)
    back_ExCxD = ep.return_to_sources(recv_NxXxCxD)
    rows_mxD = back_ExCxD.reshape(E * C, D)[jnp.where(keep_m, slot_m, 0)]
    return rows_mxD.reshape(b, l, K, D), keep_m.reshape(b, l, K)

  spec = P(("data", "expert"))
  with jax.set_mesh(mesh):
    rows, keep = jax.jit(jax.shard_map(body, in_specs=(spec, spec), out_specs=(spec, spec)))(x, idx)
  assert bool(keep.all())
  np.testing.assert_array_equal(np.asarray(rows), np.broadcast_to(np.asarray(x)[:, :, None], rows.shape))



def test_ragged_all_to_all_reference_hand_computed():
  """2 devices, operands [a0 a1 a2] and [b0 b1 b2]; device 0 sends a0 to itself and a1 a2 to device 1, device 1
  sends b0 b1 to device 0 (after device 0's row) and nothing to itself. Unwritten output rows keep their -1."""
  mesh = make_mesh({"expert": 2}, devices=jax.devices()[:2])
  operand = jnp.array([[1.0], [2.0], [3.0], [11.0], [12.0], [13.0]])  # a = 1, 2, 3; b = 11, 12, 13
  i32 = lambda *v: jnp.array(v, jnp.int32)
  input_offsets, send_sizes = i32(0, 1, 0, 0), i32(1, 2, 2, 0)
  output_offsets, recv_sizes = i32(0, 0, 1, 0), i32(1, 2, 2, 0)  # per device: [to/from device 0, device 1]
  f = jax.shard_map(functools.partial(ep.ragged_all_to_all_reference, axis_name="expert"), mesh=mesh,
                    in_specs=(P("expert"),) * 6, out_specs=P("expert"))
  out = f(operand, -jnp.ones((8, 1)), input_offsets, send_sizes, output_offsets, recv_sizes)
  np.testing.assert_array_equal(np.asarray(out)[:, 0], [1, 11, 12, -1, 2, 3, -1, -1])

def test_dropped_assignments_hand_computed():
  """4 devices x 4 tokens, K=2, E=8, capacity factor 1: C = ceil(1 * 4 * 2 / 8) = 1 slot per (device, expert).

  Device 0 sends all 4 tokens to experts (0, 1): each keeps 1 of 4, so 6 assignments drop. Devices 1-3 give token
  j experts (2j, 2j+1): one assignment per expert, nothing drops. Device 3's last two tokens are padding (take no
  slot, are not counted). dropped_fraction = 6 / (32 - 4).
  """
  mesh = make_mesh({"expert": 4}, devices=jax.devices()[:4])
  B, L, D = 4, 4, CFG.hidden_size
  routing = np.zeros((B, L, K), np.int32)
  routing[0] = [0, 1]
  routing[1:] = np.stack([2 * np.arange(L), 2 * np.arange(L) + 1], -1)
  valid = np.ones((B, L), bool)
  valid[3, 2:] = False
  cfg = dataclasses.replace(CFG, moe_impl="ep_capacity", capacity_factor=1.0)
  p = _moe_params(CFG)
  x = jax.random.normal(jax.random.key(3), (B, L, D))
  with jax.set_mesh(mesh):
    out, aux = jax.jit(lambda p, x, r: moe_lib.moe_block(p, x, jnp.asarray(valid), cfg, r))(p, x, routing)
  np.testing.assert_allclose(float(aux["dropped_fraction"]), 6 / 28, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(aux["experts"]), routing)  # replayed experts are the ones used
  # Dropped assignments fall back to the shared expert only: device 0's tokens 1-3 and padding get no routed output.
  idx, w = routing, np.asarray(_routed_weights(p, x, routing))
  y, _ = _ep(p, x, jnp.asarray(idx), jnp.asarray(w), jnp.asarray(valid), cfg, mesh)
  keep = np.ones((B, L, K), bool)
  keep[0, 1:] = False
  keep[3, 2:] = False
  ref, _ = _loop_reference(p, x.reshape(-1, D), idx.reshape(-1, K), (w * keep).reshape(-1, K))
  np.testing.assert_allclose(np.asarray(y).reshape(-1, D), ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(y)[0, 1:], 0.0)
  shared = mlp(p["shared"], x)
  np.testing.assert_allclose(np.asarray(out)[0, 1:], np.asarray(shared)[0, 1:], rtol=1e-6, atol=1e-6)


def _routed_weights(p, x, routing):
  B, L, D = x.shape
  s = moe_lib.router_scores(p, x.reshape(B * L, D))
  return moe_lib.gate_weights(s, jnp.asarray(routing).reshape(B * L, K), CFG).reshape(B, L, K)


def test_router_replay_under_ep_matches_single_device():
  mesh = make_mesh({"data": 2, "expert": 4})
  B, L, D, E = 8, 4, CFG.hidden_size, CFG.n_routed_experts
  p = _moe_params(CFG)
  x = jax.random.normal(jax.random.key(4), (B, L, D))
  # Replayed experts unlike the router's own choice (two distinct random experts per token).
  routing = jnp.asarray(np.argsort(np.random.default_rng(0).random((B, L, E)), -1)[..., :K].astype(np.int32))
  valid = jnp.ones((B, L), bool)
  ep_cfg = dataclasses.replace(CFG, moe_impl="ep_capacity", capacity_factor=NO_DROP)
  with jax.set_mesh(mesh):
    out, aux = jax.jit(lambda p, x, r: moe_lib.moe_block(p, x, valid, ep_cfg, r))(p, x, routing)
  ref, ref_aux = moe_lib.moe_block(p, x, valid, dataclasses.replace(CFG, moe_impl="dense"), routing)
  np.testing.assert_array_equal(np.asarray(aux["experts"]), np.asarray(routing))
  assert not np.array_equal(np.asarray(routing), np.asarray(_routed(p, x)[0]))  # replay really overrides
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=2e-6)  # as in the layer test
  np.testing.assert_array_equal(np.asarray(aux["expert_load"]), np.asarray(ref_aux["expert_load"]))


TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                   qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                   first_k_dense_replace=1, num_nextn_predict_layers=1)


def _loss(params, tokens, cfg):
  logits, aux = model.forward(params, tokens, cfg)
  logp = jax.nn.log_softmax(logits[:, :-1])
  main = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
  mtp = -jnp.take_along_axis(jax.nn.log_softmax(aux["mtp_logits"][0, :, :-2]), tokens[:, 2:, None], -1).mean()
  return main + 0.3 * mtp, aux["dropped_fraction"]


def _assert_grads_close(g, ref_g):
  """Every gradient leaf within 1e-5 of the reference, relative to that leaf's largest entry."""
  for path, a in jax.tree_util.tree_leaves_with_path(g):
    b = ref_g
    for k in path:
      b = b[k.key]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()),
                               err_msg=jax.tree_util.keystr(path))



def test_full_model_loss_and_grads_match_single_device():
  """data=2 x expert=4 (MTP on): loss and every gradient equal the single-device dense run."""
  tokens = jax.random.randint(jax.random.key(5), (8, 16), 0, TINY.vocab_size)
  ref_cfg = dataclasses.replace(TINY, moe_impl="dense")
  params = model.init(jax.random.key(0), ref_cfg)
  (ref_loss, _), ref_g = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=2)(params, tokens, ref_cfg)
  mesh = make_mesh({"data": 2, "expert": 4})
  ep_cfg = dataclasses.replace(TINY, moe_impl="ep_capacity", capacity_factor=TINY.n_routed_experts / 2)
  sharded = jax.device_put(params, model.shardings(ep_cfg, mesh))
  with jax.set_mesh(mesh):
    (loss, dropped), g = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=2)(sharded, tokens, ep_cfg)
  assert g["moe_layers"]["moe"]["gate"].sharding.spec[1] == "expert"  # expert weights (and grads) live sharded
  assert float(dropped) == 0.0
  # float32 throughout; EP changes only summation orders (the K-term combine, gradient all-reduces over data and
  # expert). Measured: loss equal to 1e-7 relative, every gradient leaf within 9e-7 of its largest entry (leaves
  # range from 4e-6 to 2e-2, so the tolerance scales with each leaf); 1e-5 leaves a 10x margin.
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  _assert_grads_close(g, ref_g)


def test_fsdp_expert_weights_are_gathered_in_the_region_and_their_grads_reduce_scattered():
  """data=2 x expert=2 x context=2 with expert weights' D FSDP-split over data x context: loss and every gradient
  equal the one-device run, and the compiled program reduce-scatters the expert-weight gradients inside the EP
  region (no all-reduce of a whole expert weight's gradient)."""
  from benchmarks import hlo_collectives as hc
  tokens = jax.random.randint(jax.random.key(5), (8, 16), 0, TINY.vocab_size)
  ref_cfg = dataclasses.replace(TINY, moe_impl="dense")
  params = model.init(jax.random.key(0), ref_cfg)
  (ref_loss, _), ref_g = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=2)(params, tokens, ref_cfg)
  mesh = make_mesh({"data": 2, "expert": 2, "context": 2})
  rules = ShardingRules(batch=("data", "expert"), embed=("data", "context"), expert_embed=("data", "context"))
  ep_cfg = dataclasses.replace(TINY, moe_impl="ep_capacity", capacity_factor=TINY.n_routed_experts / 2)
  sharded = jax.device_put(params, model.shardings(ep_cfg, mesh, rules))
  assert sharded["moe_layers"]["moe"]["gate"].sharding.spec[2] == ("data", "context")
  fn = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=2)
  with jax.set_mesh(mesh), use_rules(rules):
    (loss, dropped), g = fn(sharded, tokens, ep_cfg)
    text = fn.lower(sharded, tokens, ep_cfg).compile().as_text()
  assert float(dropped) == 0.0
  # Same tolerances as the data=2 x expert=4 test above (f32; only summation orders differ).
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  _assert_grads_close(g, ref_g)
  colls = hc.parse(text, 8, program_dtypes=False)
  ep = [c for c in colls if "ep_capacity" in c.op_name]
  assert any(c.kind == "reduce-scatter" and c.group_size == 4 for c in ep), [(c.kind, c.group_size) for c in ep]
  local_expert_weight = (8 // 2) * 32 * 16 * 4       # X experts x D x F, f32: one weight's gradient per device
  assert not [c for c in ep if c.kind == "all-reduce" and c.group_size > 1 and c.buffer_bytes >= local_expert_weight]


def test_ep_ragged_lowers_for_cuda_with_ragged_all_to_all():
  """XLA:CPU has no ragged-all-to-all, so the dropless path is checked by lowering forward + backward for cuda."""
  cfg = dataclasses.replace(CFG, moe_impl="ep_ragged")
  p = _moe_params(CFG)
  x = jnp.ones((8, 4, CFG.hidden_size))
  valid = jnp.ones((8, 4), bool)
  fwd = lambda p, x: moe_lib.moe_block(p, x, valid, cfg)[0].sum()
  with jax.set_mesh(make_mesh({"data": 2, "expert": 4})):
    f_text = jax.jit(fwd).trace(p, x).lower(lowering_platforms=("cuda",)).as_text()
    g_text = jax.jit(jax.grad(fwd, argnums=(0, 1))).trace(p, x).lower(lowering_platforms=("cuda",)).as_text()
  assert f_text.count("custom_call @ragged_all_to_all") == 2  # dispatch and return
  assert "all_to_all" not in f_text.replace("ragged_all_to_all", "")  # no padded fallback collective
  assert g_text.count("custom_call @ragged_all_to_all") >= 3  # the backward's transposed exchanges too
  # A bounded buffer (the scale plan's GPU rows): m = 4 tokens x K = 2 local assignments, ceil(1.25 m) = 10 rows
  # received instead of the worst case N m = 32.
  bounded = dataclasses.replace(cfg, ragged_buffer_factor=1.25)
  with jax.set_mesh(make_mesh({"data": 2, "expert": 4})):
    b_text = jax.jit(lambda p, x: moe_lib.moe_block(p, x, valid, bounded)[0].sum()).trace(p, x).lower(
        lowering_platforms=("cuda",)).as_text()
  recv = [line for line in b_text.splitlines() if "custom_call @ragged_all_to_all" in line]
  assert len(recv) == 2 and "tensor<10x" in recv[0] and "tensor<32x" in f_text


def test_ep_errors_name_the_problem():
  p = _moe_params(CFG)
  x = jnp.ones((8, 4, CFG.hidden_size))
  idx, w = _routed(p, x)
  valid = jnp.ones((8, 4), bool)
  cfg = dataclasses.replace(CFG, moe_impl="ep_capacity")
  with pytest.raises(ValueError, match="needs a mesh"):
    ep.expert_parallel(p, x, idx, w, valid, cfg)
  with pytest.raises(ValueError, match=r"batch=6 is not divisible by mesh axes \('data', 'expert'\) \(size 8\)"):
    ep.expert_parallel(p, x[:6], idx[:6], w[:6], valid[:6], cfg, mesh=make_mesh({"data": 2, "expert": 4}))
  with pytest.raises(ValueError, match="n_routed_experts=8 is not divisible"):
    ep.expert_parallel(p, x[:6], idx[:6], w[:6], valid[:6], cfg,
                       mesh=make_mesh({"expert": 3}, devices=jax.devices()[:3]))


def test_ep_ragged_gradients_match_dense():
  """The dropless path's backward (transposed exchanges, grouped matmul VJPs) against the dense layer's."""
  p = {k: v for k, v in _moe_params(CFG).items() if k in ("gate", "up", "down")}
  B, L, D = 8, 4, CFG.hidden_size
  x = jax.random.normal(jax.random.key(6), (B, L, D))
  idx, w = _routed(_moe_params(CFG), x)
  ct = jax.random.normal(jax.random.key(7), (B, L, D))  # a random cotangent so every output row matters
  cfg = dataclasses.replace(CFG, moe_impl="ep_ragged")

  def ep_loss(p, x, w):
    y, _ = ep.expert_parallel(p, x, idx, w, jnp.ones((B, L), bool), cfg,
                              ragged_all_to_all=ep.ragged_all_to_all_reference)
    return (y * ct).sum()

  def dense_loss(p, x, w):
    y = experts_lib.experts_dense(p, x.reshape(-1, D), idx.reshape(-1, K), w.reshape(-1, K))
    return (y.reshape(B, L, D) * ct).sum()

  with jax.set_mesh(make_mesh({"data": 2, "expert": 4})):
    g = jax.jit(jax.grad(ep_loss, argnums=(0, 1, 2)))(p, x, w)
  ref = jax.grad(dense_loss, argnums=(0, 1, 2))(p, x, w)
  # float32; as in the forward only summation orders differ (here also over the tokens an expert's weight gradient
  # sums). Measured within 3e-7 of each gradient's largest entry (~10); 1e-5 leaves a 30x margin.
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


def test_ragged_plan_matches_filling_each_buffer_in_order():
  """`ragged_plan` against a loop that fills each destination's buffer source by source, local expert by local
  expert, until `rows` rows are used; offsets are exclusive cumulative sums of the chunk sizes."""
  rng = np.random.default_rng(0)
  N, X = 4, 3
  counts = rng.integers(0, 6, (N, N, X))
  for rows in (N * counts.sum(axis=(1, 2)).max(), 20, 7, 0):
    plan = jax.tree.map(np.asarray, ep.ragged_plan(jnp.asarray(counts), rows))
    kept = np.zeros_like(counts)
    for d in range(N):
      used = 0
      for s in range(N):
        for x in range(X):
          kept[s, d, x] = min(counts[s, d, x], max(rows - used, 0))
          used += kept[s, d, x]
    sent = counts.sum(-1)
    np.testing.assert_array_equal(plan["kept_NxNxX"], kept)
    np.testing.assert_array_equal(plan["kept"], kept.sum(-1))
    np.testing.assert_array_equal(plan["in_off"], np.cumsum(sent, 1) - sent)    # within the source's sorted rows
    np.testing.assert_array_equal(plan["out_off"], np.cumsum(sent, 0) - sent)   # at the destination
    assert ((plan["kept"] == 0) | (plan["out_off"] + plan["kept"] <= rows)).all()  # kept rows fit the buffer
  assert ep.ragged_buffer_rows(16, 4, 0.0) == 64 and ep.ragged_buffer_rows(16, 4, 1.25) == 20


def test_ep_ragged_bounded_buffer_drops_what_the_plan_cuts():
  """expert=4, receive buffers of ceil(0.5 x m) rows (reference collective): the output is the dense layer's with
  the cut assignments' gates zeroed (found by a numpy model of the exchange: each source's assignments sorted by
  expert, the first `kept` of each destination's chunk kept), and dropped_fraction counts them; a factor of 4
  (= N) never cuts and equals the dense layer."""
  p = _moe_params(CFG)
  B, L, N = 8, 4, 4
  x = jax.random.normal(jax.random.key(3), (B, L, CFG.hidden_size))
  idx, w = _routed(p, x)
  T, D, X = B * L, CFG.hidden_size, CFG.n_routed_experts // N
  mesh = make_mesh({"expert": N}, devices=jax.devices()[:N])
  for factor in (0.5, 4.0):
    cfg = dataclasses.replace(CFG, moe_impl="ep_ragged", ragged_buffer_factor=factor)
    y, dropped = _ep(p, x, idx, w, jnp.ones((B, L), bool), cfg, mesh,
                     ragged_all_to_all=ep.ragged_all_to_all_reference)
    e_sxm = np.asarray(idx).reshape(N, -1)                        # device s holds rows [s B/N, (s+1) B/N)
    m = e_sxm.shape[1]
    counts = np.stack([np.bincount(e, minlength=N * X).reshape(N, X) for e in e_sxm])
    kept = np.asarray(ep.ragged_plan(jnp.asarray(counts), ep.ragged_buffer_rows(m, N, factor))["kept"])
    keep_sxm = np.zeros_like(e_sxm, bool)
    for s in range(N):
      order = np.argsort(e_sxm[s], kind="stable")
      for d in range(N):
        chunk = order[e_sxm[s][order] // X == d]
        keep_sxm[s, chunk[:kept[s, d]]] = True
    w_kept = jnp.where(jnp.asarray(keep_sxm.reshape(B, L, K)), w, 0.0)
    ref = experts_lib.experts_dense(p, x.reshape(T, D), idx.reshape(T, K), w_kept.reshape(T, K))
    assert float(dropped) == pytest.approx((~keep_sxm).mean())
    assert (factor == 4.0) == keep_sxm.all()
    np.testing.assert_allclose(np.asarray(y).reshape(T, D), ref, rtol=1e-6, atol=2e-6)
