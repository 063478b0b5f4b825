"""The cached forward (prefill + absorbed-MLA decode + MTP) against the model's full forward."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.model.attention import attend, attend_latent, expand_kv
from composer_jax.model.rope import softmax_scale
from composer_jax.sampling import cached_model as cm

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, num_nextn_predict_layers=1)
# Tolerances: all float32; cached and full forwards differ only in summation order (~1e-6 relative).
ATOL = 2e-5


def test_absorbed_attention_equals_expanded():
  params = model.init(jax.random.key(0), dataclasses.replace(CFG, initializer_range=0.2))
  p = jax.tree.map(lambda a: a[0], params["moe_layers"])["attn"]
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  B, L, S, H = 2, 3, 7, CFG.num_attention_heads
  q = jax.random.normal(k1, (B, L, H, CFG.qk_head_dim))
  c = jax.random.normal(k2, (B, S, CFG.kv_lora_rank))
  kr = jax.random.normal(k3, (B, S, CFG.qk_rope_head_dim))
  mask = cm.cache_mask(jnp.array([[4, 5, 6], [2, 3, 4]]), jnp.array([0, 2]), S)
  k, v = expand_kv(p, c, kr)
  want = attend(q, k, v, mask, softmax_scale(CFG))
  got = attend_latent(p, q, c, kr, mask, CFG)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_attention_over_a_cache_expanded_equals_latent():
  """`KVCache.expand` (a prefill window over reused rows) equals the absorbed form decode uses: same output, same
  cache writes."""
  from composer_jax.model.attention import KVCache, attention
  from composer_jax.model.rope import rope_cos_sin
  params = model.init(jax.random.key(0), dataclasses.replace(CFG, initializer_range=0.2))
  p = jax.tree.map(lambda a: a[0], params["moe_layers"])["attn"]
  k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
  B, L, S = 2, 4, 11
  x = jax.random.normal(k1, (B, L, CFG.hidden_size))
  c = jax.random.normal(k2, (B, S, CFG.kv_lora_rank))
  kr = jax.random.normal(k3, (B, S, CFG.qk_rope_head_dim))
  start, pad = jnp.array([5, 6]), jnp.array([0, 3])
  slots, positions, _ = cm.slot_info(start, pad, L)
  cos, sin = rope_cos_sin(positions, CFG)
  mask = cm.cache_mask(slots, pad, S)
  out = {e: attention(p, x, cos, sin, mask, CFG, KVCache(c, kr, start, expand=e)) for e in (False, True)}
  np.testing.assert_allclose(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(out[True][1].c, out[False][1].c)
  np.testing.assert_array_equal(out[True][1].kr, out[False][1].kr)


def padded_reference(params, tokens_BxL, pad_B, cfg):
  """The trainer's forward on left-padded rows: padding is segment 0, positions restart at the first real token."""
  slots = jnp.arange(tokens_BxL.shape[1])[None, :]
  valid = slots >= pad_B[:, None]
  return model.forward(params, tokens_BxL, cfg, segment_ids=valid.astype(jnp.int32),
                       positions=jnp.where(valid, slots - pad_B[:, None], 0))


@pytest.mark.parametrize("variant", ["plain", "tied_qlora_yarn"])
def test_prefill_then_decode_matches_forward(variant):
  """Left-padded prefill + token-by-token decode = the trainer's forward: logits, experts, MTP logits."""
  cfg = CFG
  if variant != "plain":
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True, q_lora_rank=8, n_group=2, topk_group=1,
                              rope_scaling=model.RopeScaling(factor=4.0, original_max_position_embeddings=8,
                                                             mscale=1.0, mscale_all_dim=1.0))
  params = model.init(jax.random.key(1), dataclasses.replace(cfg, initializer_range=0.2))
  rng = np.random.default_rng(0)
  P, T = 6, 4  # padded prompt width, decoded tokens
  pad = jnp.array([1, 3], jnp.int32)
  seq = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, P + T)), jnp.int32)
  seq = jnp.where(jnp.arange(P + T)[None] < pad[:, None], 0, seq)
  ref_logits, aux = jax.jit(functools.partial(padded_reference, cfg=cfg))(params, seq, pad)

  fwd = jax.jit(cm.forward_cached, static_argnames=("cfg", "fresh"))
  cache = cm.init_cache(params, cfg, 2, P + T)
  logits, h, experts, cache = fwd(params, seq[:, :P], cache, jnp.zeros(2, jnp.int32), pad, cfg, fresh=True)
  for b in range(2):
    real = slice(int(pad[b]), P)
    np.testing.assert_allclose(logits[b, real], ref_logits[b, real], atol=ATOL)
    np.testing.assert_array_equal(experts[:, b, real], aux["experts"][:, b, real])
  for t in range(P, P + T):
    lg, _, ex, cache = fwd(params, seq[:, t:t + 1], cache, jnp.full(2, t, jnp.int32), pad, cfg)
    np.testing.assert_allclose(lg[:, 0], ref_logits[:, t], atol=ATOL)
    np.testing.assert_array_equal(ex[:, :, 0], aux["experts"][:, :, t])
  # MTP module 0 at slot t combines the hidden at t with the token at t+1.
  mtp_cache = cm.init_cache(params, cfg, 2, P + T)
  mtp_logits, _ = jax.jit(cm.mtp_cached, static_argnames=("cfg", "fresh"))(
      params, h, seq[None, :, 1:P + 1], mtp_cache, jnp.zeros(2, jnp.int32), pad, cfg, fresh=True)
  for b in range(2):
    real = slice(int(pad[b]), P)
    np.testing.assert_allclose(mtp_logits[0, b, real], aux["mtp_logits"][0, b, real], atol=ATOL)


def test_padded_forward_equals_unpadded():
  """The left-padding convention the engine and the trainer share leaves the real tokens' outputs unchanged."""
  params = model.init(jax.random.key(2), dataclasses.replace(CFG, initializer_range=0.2))
  seq = jnp.asarray(np.random.default_rng(1).integers(1, CFG.vocab_size, size=(1, 5)), jnp.int32)
  padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), seq], axis=1)
  lg_pad, aux_pad = jax.jit(functools.partial(padded_reference, cfg=CFG))(params, padded, jnp.array([3]))
  lg, aux = jax.jit(functools.partial(model.forward, cfg=CFG))(params, seq)
  np.testing.assert_allclose(lg_pad[:, 3:], lg, atol=ATOL)
  np.testing.assert_array_equal(aux_pad["experts"][:, :, 3:], aux["experts"])


def test_cache_is_latent_sized():
  cache = cm.init_cache(model.init(jax.random.key(0), CFG), CFG, batch=3, slots=10)
  per_token_layer = sum(a.shape[-1] for a in jax.tree.leaves(cache["moe_layers"]))
  assert per_token_layer == CFG.kv_lora_rank + CFG.qk_rope_head_dim
  assert cache["moe_layers"]["c"].shape == (2, 3, 10, CFG.kv_lora_rank)
  assert cache["mtp"]["kr"].shape == (1, 3, 10, CFG.qk_rope_head_dim)
