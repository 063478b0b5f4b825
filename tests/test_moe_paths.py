"""MoE router and the expert compute paths against a per-expert Python-loop reference."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.model import ModelConfig, param_specs
from composer_jax.model import experts as experts_lib
from composer_jax.model import moe as moe_lib
from composer_jax.model.params import ArrayInfo

CFG = ModelConfig(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, num_hidden_layers=2, first_k_dense_replace=1, vocab_size=32,
                  routed_scaling_factor=2.5, n_group=4, topk_group=2)


@functools.cache
def _moe_params_cached(cfg, seed):
  # One MoE layer's params from the model's own description (without compiling the whole model's init).
  leaves, treedef = jax.tree.flatten(param_specs(cfg)["moe_layers"]["moe"], is_leaf=lambda x: isinstance(x, ArrayInfo))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  p = jax.tree.unflatten(treedef, [a.initializer(k, a.shape[1:], a.dtype) for k, a in zip(keys, leaves)])
  # Random, non-zero selection bias so selection-by-bias is exercised; larger router weights separate the scores.
  p["bias"] = 0.1 * jax.random.normal(jax.random.key(seed + 1), p["bias"].shape)
  p["router"] = p["router"] * 50.0
  for k in ("gate", "up", "down"):
    p[k] = p[k] * 10.0
  return p


def _moe_params(cfg, seed=0):
  return dict(_moe_params_cached(cfg, seed))


def _select_reference(scores, bias, cfg):
  """Group-limited top-k written out per token in numpy."""
  T, E = scores.shape
  G, per = cfg.n_group, E // cfg.n_group
  out = []
  for t in range(T):
    b = scores[t] + bias
    gs = [np.sort(b[g * per:(g + 1) * per])[-2:].sum() for g in range(G)]
    groups = np.argsort(gs)[::-1][:cfg.topk_group]
    masked = np.full(E, -np.inf)
    for g in groups:
      masked[g * per:(g + 1) * per] = b[g * per:(g + 1) * per]
    out.append(np.sort(np.argsort(masked)[::-1][:cfg.num_experts_per_tok]))
  return np.array(out)


def _loop_reference(p, x_TxD, idx_TxK, w_TxK, capacity=None):
  """Per-expert loop: each expert runs on the tokens that chose it (in token order, up to `capacity`)."""
  x, idx, w = (np.asarray(a, np.float64) for a in (x_TxD, idx_TxK, w_TxK))
  idx = idx.astype(int)
  out = np.zeros_like(x)
  dropped = 0
  for e in range(p["gate"].shape[0]):
    g, u, d = (np.asarray(p[k][e], np.float64) for k in ("gate", "up", "down"))
    taken = 0
    for t in range(x.shape[0]):
      for k in range(idx.shape[1]):
        if idx[t, k] != e:
          continue
        if capacity is not None and taken >= capacity:
          dropped += 1
          continue
        taken += 1
        a = x[t] @ g
        out[t] += w[t, k] * (((a / (1 + np.exp(-a))) * (x[t] @ u)) @ d)
  return out, dropped / idx.size


def _routed(T: int, seed: int):
  """Params, T random tokens and their routing (expert ids and gate weights) through the model's own router."""
  p = _moe_params(CFG)
  x = jax.random.normal(jax.random.key(seed), (T, CFG.hidden_size))
  scores = moe_lib.router_scores(p, x)
  idx = moe_lib.select_experts(scores, p["bias"], CFG)
  return p, x, idx, moe_lib.gate_weights(scores, idx, CFG)


def test_select_experts_matches_numpy_group_limited_topk():
  p = _moe_params(CFG)
  x = jax.random.normal(jax.random.key(3), (64, CFG.hidden_size))
  scores = moe_lib.router_scores(p, x)
  idx = moe_lib.select_experts(scores, p["bias"], CFG)
  ref = _select_reference(np.asarray(scores, np.float64), np.asarray(p["bias"], np.float64), CFG)
  np.testing.assert_array_equal(np.sort(np.asarray(idx), axis=1), ref)
  # Group-limiting really binds: every token's experts lie in at most topk_group groups.
  per = CFG.n_routed_experts // CFG.n_group
  assert max(len(set((np.asarray(idx[t]) // per).tolist())) for t in range(64)) <= CFG.topk_group


def test_gate_weights_normalised_and_scaled():
  scores = jnp.array([[0.9, 0.1, 0.6, 0.2]])
  idx = jnp.array([[0, 2]])
  cfg = dataclasses.replace(CFG, routed_scaling_factor=2.5, norm_topk_prob=True)
  np.testing.assert_allclose(moe_lib.gate_weights(scores, idx, cfg), [[2.5 * 0.9 / 1.5, 2.5 * 0.6 / 1.5]], rtol=1e-6)
  cfg = dataclasses.replace(cfg, norm_topk_prob=False)
  np.testing.assert_allclose(moe_lib.gate_weights(scores, idx, cfg), [[2.25, 1.5]], rtol=1e-6)


@pytest.mark.parametrize("impl", ["dense", "blocked", "ragged", "capacity_unbounded"])
def test_paths_match_loop_reference(impl):
  T = 24
  p, x, idx, w = _routed(T, 4)
  ref, _ = _loop_reference(p, x, idx, w)
  if impl == "dense":
    out = experts_lib.experts_dense(p, x, idx, w)
  elif impl == "blocked":
    out = jax.jit(experts_lib.experts_blocked)(p, x, idx, w)
  elif impl == "ragged":
    out = jax.jit(experts_lib.experts_ragged)(p, x, idx, w)
  else:
    # Capacity factor E/K guarantees C >= T: nothing can be dropped, so it must equal the others.
    out, dropped = experts_lib.experts_capacity(p, x, idx, w, jnp.ones(T, bool),
                                            CFG.n_routed_experts / CFG.num_experts_per_tok)
    assert float(dropped) == 0.0
  # float32 matmuls over D=16, F=8 with O(10) activations: ~1e-5 relative error.
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)


def test_capacity_drops_like_loop_reference():
  T = 32
  p, x, idx, w = _routed(T, 5)
  factor = 0.5
  C = experts_lib.capacity(factor, T, CFG.num_experts_per_tok, CFG.n_routed_experts)
  out, dropped = experts_lib.experts_capacity(p, x, idx, w, jnp.ones(T, bool), factor)
  ref, ref_dropped = _loop_reference(p, x, idx, w, capacity=C)
  assert ref_dropped > 0, "test must exercise dropping"
  np.testing.assert_allclose(float(dropped), ref_dropped, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)


def test_capacity_ignores_padding_tokens():
  T = 16
  p, x, idx, w = _routed(T, 6)
  valid = jnp.arange(T) < 10
  out, dropped = experts_lib.experts_capacity(p, x, idx, w, valid, 8.0)
  ref, _ = _loop_reference(p, x[:10], idx[:10], w[:10])
  np.testing.assert_allclose(np.asarray(out[:10]), ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(out[10:]), 0.0)
  assert float(dropped) == 0.0


def test_moe_block_paths_agree_and_aux():
  x = jax.random.normal(jax.random.key(7), (2, 8, CFG.hidden_size))
  valid = jnp.ones((2, 8), bool).at[1, 6:].set(False)
  p = _moe_params(CFG)
  outs = {}
  for impl in ("dense", "ragged", "capacity"):
    cfg = dataclasses.replace(CFG, moe_impl=impl, capacity_factor=4.0)
    outs[impl], aux = moe_lib.moe_block(p, x, valid, cfg)
  np.testing.assert_allclose(outs["ragged"], outs["dense"], rtol=1e-4, atol=1e-4)
  # Padding tokens take no capacity slot (they get only the shared expert), so compare valid tokens.
  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(outs["capacity"])[v], np.asarray(outs["dense"])[v], rtol=1e-4, atol=1e-4)
  # expert_load counts valid tokens' assignments only: 14 tokens * K.
  assert float(aux["expert_load"].sum()) == 14 * CFG.num_experts_per_tok
  np.testing.assert_array_equal(np.asarray(aux["expert_load"]),
                                np.bincount(np.asarray(aux["experts"])[np.asarray(valid)].ravel(),
                                            minlength=CFG.n_routed_experts))


def test_balance_loss_hand_computed():
  # One row, 2 tokens, E=2, K=1: token 0 -> expert 0, token 1 -> expert 0.
  scores = jnp.array([[[0.6, 0.2], [0.5, 0.5]]])
  idx = jnp.array([[[0], [0]]])
  # f = E/(K*T) * counts = [2, 0]; P = mean of normalised scores = [(0.75 + 0.5)/2, ...] -> loss = 2 * 0.625.
  np.testing.assert_allclose(moe_lib.sequence_balance_loss(scores, idx, jnp.ones((1, 2), bool)), 1.25, rtol=1e-6)


def test_bias_has_no_gradient_but_router_does():
  p = _moe_params(CFG)
  x = jax.random.normal(jax.random.key(8), (1, 8, CFG.hidden_size))
  g = jax.grad(lambda p: moe_lib.moe_block(p, x, jnp.ones((1, 8), bool), CFG)[0].sum())(p)
  assert float(jnp.abs(g["bias"]).max()) == 0.0
  assert float(jnp.abs(g["router"]).max()) > 0.0


def test_bad_config_errors():
  with pytest.raises(ValueError, match="moe_impl"):
    param_specs(dataclasses.replace(CFG, moe_impl="sparse"))
  with pytest.raises(ValueError, match="n_group"):
    param_specs(dataclasses.replace(CFG, n_group=3))


def test_moe_impl_registry_auto_and_errors():
  assert moe_lib.resolve_moe_impl(dataclasses.replace(CFG, moe_impl="auto"), "cpu") == "blocked"
  assert moe_lib.resolve_moe_impl(dataclasses.replace(CFG, moe_impl="auto"), "cuda") == "ragged"
  # Quantised expert matmuls need the grouped path on every platform.
  assert moe_lib.resolve_moe_impl(dataclasses.replace(CFG, moe_impl="auto", moe_matmul="mxfp8"), "cpu") == "ragged"
  assert moe_lib.resolve_moe_impl(dataclasses.replace(CFG, moe_impl="capacity"), "cuda") == "capacity"
  with pytest.raises(ValueError, match=r"moe_impl='sparse'; valid: \['auto', 'dense', 'blocked', 'ragged', 'capacity'"):
    moe_lib.check_moe_impl("sparse")


@pytest.mark.parametrize("impl", ["auto", "dense", "blocked", "ragged"])
def test_moe_block_equals_loop_reference_with_shared_expert(impl):
  p = _moe_params(CFG)
  x = jax.random.normal(jax.random.key(9), (2, 6, CFG.hidden_size))
  cfg = dataclasses.replace(CFG, moe_impl=impl)
  out, aux = jax.jit(moe_lib.moe_block, static_argnums=3)(p, x, jnp.ones((2, 6), bool), cfg)
  x_TxD = x.reshape(12, -1)
  w = moe_lib.gate_weights(aux["router_scores"].reshape(12, -1), aux["experts"].reshape(12, -1), CFG)
  routed, _ = _loop_reference(p, x_TxD, aux["experts"].reshape(12, -1), w)
  from composer_jax.model.layers import mlp
  ref = routed + np.asarray(mlp(p["shared"], x_TxD), np.float64)
  np.testing.assert_allclose(np.asarray(out).reshape(12, -1), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["dense", "blocked", "ragged", "capacity"])
def test_moe_paths_lower_for_cuda(impl):
  p = _moe_params(CFG)
  x = jax.random.normal(jax.random.key(10), (2, 8, CFG.hidden_size))
  cfg = dataclasses.replace(CFG, moe_impl=impl)
  f = jax.jit(jax.grad(lambda p, x: moe_lib.moe_block(p, x, jnp.ones((2, 8), bool), cfg)[0].sum(), argnums=(0, 1)))
  f.trace(p, x).lower(lowering_platforms=("cuda",))


def test_dense_with_precomputed_layout_equals_without():
  p, x, idx, w = _routed(10, 11)
  laid = experts_lib.dense_layout(p)
  assert laid["gate_up"].shape == (CFG.hidden_size, 2 * CFG.n_routed_experts * CFG.moe_intermediate_size)
  np.testing.assert_allclose(experts_lib.experts_dense(laid, x, idx, w), experts_lib.experts_dense(p, x, idx, w),
                             rtol=1e-6, atol=1e-6)
  # A stack's layout is the per-layer layouts stacked (the decode loop slices it per layer).
  stacked = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), p)
  np.testing.assert_array_equal(experts_lib.dense_layout(stacked)["gate_up"][1],
                                experts_lib.dense_layout(jax.tree.map(lambda a: 2 * a, p))["gate_up"])


def test_block_rows_by_mean_load():
  # A quarter of the mean load as a power of two, kept in [128, 512], never above the mean load itself (>= 8).
  assert experts_lib.block_rows(4096, 8) == 128      # colab step: m = 512
  assert experts_lib.block_rows(4096, 32) == 128     # small step: m = 128
  assert experts_lib.block_rows(8192, 4) == 512      # the RL model's SFT batch: m = 2048
  assert experts_lib.block_rows(48, 8) == 4 * 2 and experts_lib.block_rows(3, 8) == 8


@pytest.mark.parametrize("routing", ["skewed", "one_expert", "exact_blocks"])
@pytest.mark.parametrize("block", [None, 4])
def test_blocked_forward_and_grads_equal_dense(routing, block):
  """Uneven loads (empty experts, one expert taking every assignment, loads that are whole blocks): the blocked
  path's output and its gradients (x, gate/up/down weights, gate weights) equal the dense path's."""
  p = {k: v for k, v in _moe_params(CFG).items() if k in ("gate", "up", "down")}
  T, K, E = 16, CFG.num_experts_per_tok, CFG.n_routed_experts
  x = jax.random.normal(jax.random.key(12), (T, CFG.hidden_size))
  w = jax.random.uniform(jax.random.key(13), (T, K), minval=0.1)
  if routing == "skewed":      # experts 0 and 1 take most assignments, 5-7 none
    idx = jnp.stack([jnp.arange(T) % 2, 2 + jnp.arange(T) % 3], 1)
  elif routing == "one_expert":   # every token's first choice is expert 3 (distinct second choices)
    idx = jnp.stack([jnp.full(T, 3), jnp.where(jnp.arange(T) % E == 3, 4, jnp.arange(T) % E)], 1)
  else:                        # 4 per expert: whole blocks of 4 with no padding row
    idx = jnp.stack([jnp.arange(T) % E, (jnp.arange(T) + 1) % E], 1)
  idx = idx.astype(jnp.int32)

  def loss(f):
    return lambda p, x, w: (jnp.sin(f(p, x, idx, w)) * jnp.arange(CFG.hidden_size)[None, :]).sum()
  blocked = jax.jit(jax.value_and_grad(loss(functools.partial(experts_lib.experts_blocked, block=block)),
                                       argnums=(0, 1, 2)))
  dense = jax.value_and_grad(loss(experts_lib.experts_dense), argnums=(0, 1, 2))
  (vb, gb), (vd, gd) = blocked(p, x, w), dense(p, x, w)
  np.testing.assert_allclose(vb, vd, rtol=1e-5, atol=1e-4)
  for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gd), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
