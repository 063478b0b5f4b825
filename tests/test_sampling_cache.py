"""The cached forward (prefill + absorbed-MLA decode) against the model's full forward."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.model.attention import attend, expand_kv
from composer_jax.sampling import cached_model as cm

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, num_nextn_predict_layers=1, initializer_range=0.2)


@pytest.fixture(scope="module")
def params():
  return model.init(jax.random.key(0), CFG)


def test_absorbed_attention_equals_expanded(params):
  p = jax.tree.map(lambda a: a[0], params["moe_layers"])["attn"]
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  B, L, S, H = 2, 3, 7, CFG.num_attention_heads
  q = jax.random.normal(k1, (B, L, H, CFG.qk_head_dim))
  c = jax.random.normal(k2, (B, S, CFG.kv_lora_rank))
  kr = jax.random.normal(k3, (B, S, CFG.qk_rope_head_dim))
  mask = cm.cache_mask(jnp.array([[4, 5, 6], [2, 3, 4]]), jnp.array([0, 2]), S)
  k, v = expand_kv(p, c, kr)
  want = attend(q, k, v, mask, cm.softmax_scale(CFG))
  got = cm.attend_latent(p, q, c, kr, mask, CFG)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # f32, only the summation order differs


@pytest.mark.parametrize("tie", [False, True])
def test_prefill_then_decode_matches_forward(tie):
  """Left-padded prefill + token-by-token decode gives the unpadded full forward's logits, experts, MTP logits."""
  cfg = dataclasses.replace(CFG, tie_word_embeddings=tie)
  params = model.init(jax.random.key(0), cfg)
  rng = np.random.default_rng(0)
  n, P, T = [5, 3], 6, 4  # prompt lengths, padded prompt width, decoded tokens
  seqs = [rng.integers(0, cfg.vocab_size, size=m + T) for m in n]
  pad = jnp.array([P - m for m in n], jnp.int32)
  prompt = jnp.array([np.concatenate([np.zeros(P - m, int), s[:m]]) for m, s in zip(n, seqs)], jnp.int32)
  cache = cm.init_cache(params, cfg, 2, P + T)
  fwd = jax.jit(cm.forward_cached, static_argnames=("cfg", "fresh"))
  logits, h, experts, cache = fwd(params, prompt, cache, jnp.zeros(2, jnp.int32), pad, cfg, fresh=True)
  step_logits, step_experts = [logits[:, -1]], [experts[:, :, -1]]
  for t in range(T):
    tok = jnp.array([[s[m + t]] for m, s in zip(n, seqs)], jnp.int32)
    lg, _, ex, cache = fwd(params, tok, cache, jnp.full(2, P + t, jnp.int32), pad, cfg)
    step_logits.append(lg[:, 0])
    step_experts.append(ex[:, :, 0])
  for b, (m, s) in enumerate(zip(n, seqs)):
    ref_logits, aux = model.forward(params, jnp.array(s[None]), cfg)
    # prefill: the prompt's real positions.
    np.testing.assert_allclose(logits[b, P - m:], ref_logits[0, :m], atol=2e-5)
    np.testing.assert_array_equal(experts[:, b, P - m:], aux["experts"][:, 0, :m])
    for t in range(T):  # decode step t consumed token m+t
      np.testing.assert_allclose(step_logits[t + 1][b], ref_logits[0, m + t], atol=2e-5)
      np.testing.assert_array_equal(step_experts[t + 1][:, b], aux["experts"][:, 0, m + t])
  # MTP over the prompt (module 0 at slot t sees the token at t+1) equals the model's MTP logits.
  b, m, s = 0, n[0], seqs[0]
  nxt = jnp.concatenate([prompt[:, 1:], jnp.zeros((2, 1), jnp.int32)], axis=1)[None]
  mtp_cache = cm.init_cache(params, cfg, 2, P + T)
  mtp_logits, _ = cm.mtp_cached(params, h, nxt, mtp_cache, jnp.zeros(2, jnp.int32), pad, cfg, fresh=True)
  _, aux = model.forward(params, jnp.array(s[None, :m]), cfg)
  np.testing.assert_allclose(mtp_logits[0, b, P - m:P - 1], aux["mtp_logits"][0, 0, :m - 1], atol=2e-5)


def test_cache_is_latent_sized(params):
  cache = cm.init_cache(params, CFG, batch=3, slots=10)
  per_token_layer = sum(a.shape[-1] for a in jax.tree.leaves(cache["moe_layers"]))
  assert per_token_layer == CFG.kv_lora_rank + CFG.qk_rope_head_dim
  assert cache["moe_layers"]["c"].shape == (2, 3, 10, CFG.kv_lora_rank)
