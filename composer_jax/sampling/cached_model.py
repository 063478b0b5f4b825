"""The model run incrementally over an MLA KV cache that stores only the latent `c` and the shared rope key `kr`.

Per token and layer the cache holds C + R numbers (colab: 64 + 16) instead of H * (Q + Dv) for expanded keys and
values (colab: 4 * (48 + 32) = 320): DeepSeek-V3's MLA memory saving. Decode attends in latent space ("absorbed"
MLA: k_b folded into the query, v_b applied after the softmax), so keys/values are never expanded; prefill from an
empty cache uses the model's own expanded path (`attention.attend`), exactly as the trainer's forward.

Slots: row b's prompt is left-padded, `pad_B[b]` padding slots first; slot s holds RoPE position s - pad_B[b]. A
query at slot q sees keys at slots pad_B[b] <= s <= q, so stale entries past a row's pointer (rejected drafts) are
never read before being overwritten. Every row has its own write pointer `start_B` (speculative decoding accepts a
different number of tokens per row).

Letters: B batch, L new tokens, S cache slots, D hidden, V vocab, H heads, Qn nope head dim, R rope head dim,
C kv_lora_rank, Dv value head dim, K experts per token, Lm MoE layers, N layers of a stack.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.model.attention import attend, expand_kv, latent_kv, queries
from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import mlp, rms_norm
from composer_jax.model.moe import moe_block
from composer_jax.model.rope import rope_cos_sin, softmax_scale

STACKS = ("dense_layers", "moe_layers")


def init_cache(params: dict, cfg: ModelConfig, batch: int, slots: int) -> dict:
  """Zeroed cache: for each layer stack (and `mtp`), c [N, B, S, C] and kr [N, B, S, R] in the compute dtype."""
  dt = jnp.dtype(cfg.compute_dtype)
  cache = {}
  for name in (*STACKS, "mtp"):
    if name in params:
      n = jax.tree.leaves(params[name])[0].shape[0]
      cache[name] = {"c": jnp.zeros((n, batch, slots, cfg.kv_lora_rank), dt),
                     "kr": jnp.zeros((n, batch, slots, cfg.qk_rope_head_dim), dt)}
  return cache


def write_rows(buf_BxSx_: jax.Array, new_BxLx_: jax.Array, start_B: jax.Array) -> jax.Array:
  """Writes new[b] into buf[b] at slot start_B[b] (per-row offsets)."""
  def one(buf, new, s):
    return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), s, axis=0)
  return jax.vmap(one)(buf_BxSx_, new_BxLx_, start_B)


def slot_info(start_B: jax.Array, pad_B: jax.Array, L: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(slots [B, L], RoPE positions [B, L], valid [B, L]) of L new tokens written at start_B."""
  slots_BxL = start_B[:, None] + jnp.arange(L, dtype=jnp.int32)[None, :]
  valid_BxL = slots_BxL >= pad_B[:, None]
  return slots_BxL, jnp.where(valid_BxL, slots_BxL - pad_B[:, None], 0), valid_BxL


def cache_mask(slots_BxL: jax.Array, pad_B: jax.Array, S: int) -> jax.Array:
  """[B, L, S]: slot s visible to the query at slot q iff pad <= s <= q."""
  s_S = jnp.arange(S, dtype=jnp.int32)
  return (s_S[None, None, :] <= slots_BxL[:, :, None]) & (s_S[None, None, :] >= pad_B[:, None, None])


def attend_latent(p: dict, q_BxLxHxQ: jax.Array, c_BxSxC: jax.Array, kr_BxSxR: jax.Array, mask_BxLxS: jax.Array,
                  cfg: ModelConfig) -> jax.Array:
  """Absorbed MLA attention over cached latents → [B, L, H, Dv] (equal to expand_kv + attend)."""
  dt = q_BxLxHxQ.dtype
  q_nope, q_rope_BxLxHxR = q_BxLxHxQ[..., :cfg.qk_nope_head_dim], q_BxLxHxQ[..., cfg.qk_nope_head_dim:]
  q_lat_BxLxHxC = jnp.einsum("blhn,chn->blhc", q_nope, p["k_b"].astype(dt))
  logits_BxHxLxS = (jnp.einsum("blhc,bsc->bhls", q_lat_BxLxHxC, c_BxSxC, preferred_element_type=jnp.float32)
                    + jnp.einsum("blhr,bsr->bhls", q_rope_BxLxHxR, kr_BxSxR, preferred_element_type=jnp.float32))
  logits_BxHxLxS = jnp.where(mask_BxLxS[:, None], logits_BxHxLxS * softmax_scale(cfg), -jnp.inf)
  probs = jax.nn.softmax(logits_BxHxLxS, axis=-1, where=mask_BxLxS[:, None])
  probs = jnp.where(mask_BxLxS[:, None], probs, 0.0).astype(dt)
  o_lat_BxLxHxC = jnp.einsum("bhls,bsc->blhc", probs, c_BxSxC)
  return jnp.einsum("blhc,chv->blhv", o_lat_BxLxHxC, p["v_b"].astype(dt))


def cached_attention(p: dict, x_BxLxD: jax.Array, rope, layer_cache: dict, start_B: jax.Array, pad_B: jax.Array,
                     cfg: ModelConfig, fresh: bool) -> tuple[jax.Array, dict]:
  """MLA over the cache plus L new tokens (written at start_B); `fresh`: the cache is empty and start_B == 0."""
  cos, sin = rope
  B, L, _ = x_BxLxD.shape
  q_BxLxHxQ = queries(p, x_BxLxD, cos, sin, cfg)
  c_BxLxC, kr_BxLxR = latent_kv(p, x_BxLxD, cos, sin, cfg)
  new_cache = {"c": write_rows(layer_cache["c"], c_BxLxC, start_B),
               "kr": write_rows(layer_cache["kr"], kr_BxLxR, start_B)}
  slots_BxL, _, _ = slot_info(start_B, pad_B, L)
  if fresh:
    k_BxLxHxQ, v_BxLxHxDv = expand_kv(p, c_BxLxC, kr_BxLxR)
    out = attend(q_BxLxHxQ, k_BxLxHxQ, v_BxLxHxDv, cache_mask(slots_BxL, pad_B, L), softmax_scale(cfg))
  else:
    S = layer_cache["c"].shape[1]
    out = attend_latent(p, q_BxLxHxQ, new_cache["c"], new_cache["kr"], cache_mask(slots_BxL, pad_B, S), cfg)
  return jnp.einsum("blhv,hvd->bld", out, p["o"].astype(x_BxLxD.dtype)), new_cache


def cached_block(p: dict, x_BxLxD: jax.Array, rope, layer_cache: dict, start_B, pad_B, valid_BxL, cfg: ModelConfig,
                 fresh: bool):
  """One decoder layer over the cache → (x, new layer cache, experts [B, L, K] or None)."""
  a, new_cache = cached_attention(p["attn"], rms_norm(x_BxLxD, p["attn_norm"], cfg.rms_norm_eps), rope, layer_cache,
                                  start_B, pad_B, cfg, fresh)
  h = x_BxLxD + a
  y = rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps)
  if "moe" in p:
    out, aux = moe_block(p["moe"], y, valid_BxL, cfg)
    return h + out, new_cache, aux["experts"]
  return h + mlp(p["mlp"], y), new_cache, None


def split_layers(tree: dict) -> dict:
  """Params or cache with each layer stack (and `mtp`) as a tuple of per-layer trees instead of [N, ...] arrays.

  Decode steps run the layers of a split stack as an unrolled loop: inside a `lax.scan` every layer's weights were
  dynamic-sliced out of the stack on each step, a copy that cost more than the layers' matmuls on CPU at batch 1.
  Split once per generation call, outside the decode loop.
  """
  out = dict(tree)
  for name in (*STACKS, "mtp"):
    if name in tree and not isinstance(tree[name], tuple):
      n = jax.tree.leaves(tree[name])[0].shape[0]
      out[name] = tuple(jax.tree.map(lambda a, i=i: a[i], tree[name]) for i in range(n))
  return out


def _run_stack(stack, stack_cache, x, rope, start_B, pad_B, valid, cfg, fresh):
  if isinstance(stack, tuple):  # split_layers: unrolled
    new_cache, experts = [], []
    for p, c in zip(stack, stack_cache):
      x, c, ex = cached_block(p, x, rope, c, start_B, pad_B, valid, cfg, fresh)
      new_cache.append(c)
      experts.append(ex)
    return x, tuple(new_cache), None if experts[0] is None else jnp.stack(experts)

  def body(x, xs):
    p, c = xs
    x, c, experts = cached_block(p, x, rope, c, start_B, pad_B, valid, cfg, fresh)
    return x, (c, experts)
  x, (new_cache, experts) = jax.lax.scan(body, x, (stack, stack_cache))
  return x, new_cache, experts


def lm_head(params: dict, cfg: ModelConfig) -> jax.Array:
  return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def forward_cached(params: dict, tokens_BxL: jax.Array, cache: dict, start_B: jax.Array, pad_B: jax.Array,
                   cfg: ModelConfig, fresh: bool = False):
  """Runs the trunk on L new tokens at slots start_B.., reading and updating the cache.

  Returns:
    (logits [B, L, V] f32, last hidden before the final norm [B, L, D] (the MTP input), experts int32
    [Lm, B, L, K], new cache).
  """
  B, L = tokens_BxL.shape
  dt = jnp.dtype(cfg.compute_dtype)
  _, positions_BxL, valid_BxL = slot_info(start_B, pad_B, L)
  rope = rope_cos_sin(positions_BxL, cfg)
  x = params["embed"][tokens_BxL].astype(dt)
  new_cache = dict(cache)
  experts = jnp.zeros((0, B, L, cfg.num_experts_per_tok), jnp.int32)
  for name in STACKS:
    if name in params:
      x, new_cache[name], ex = _run_stack(params[name], cache[name], x, rope, start_B, pad_B, valid_BxL, cfg, fresh)
      if ex is not None:
        experts = ex
  logits = rms_norm(x, params["final_norm"], cfg.rms_norm_eps) @ lm_head(params, cfg).astype(dt)
  return logits.astype(jnp.float32), x, experts, new_cache


def mtp_module(params: dict, j: int, h_BxLxD: jax.Array, tokens_BxL: jax.Array, cache: dict, start_B, pad_B,
               cfg: ModelConfig, fresh: bool = False) -> tuple[jax.Array, dict]:
  """NextN module j at slots start_B..: combines hidden h_t with the token at t+1+j → (its hidden [B, L, D] before
  the module's final norm, new cache)."""
  dt = jnp.dtype(cfg.compute_dtype)
  _, positions_BxL, valid_BxL = slot_info(start_B, pad_B, h_BxLxD.shape[1])
  p = params["mtp"][j] if isinstance(params["mtp"], tuple) else jax.tree.map(lambda a: a[j], params["mtp"])
  c = cache["mtp"][j] if isinstance(cache["mtp"], tuple) else jax.tree.map(lambda a: a[j], cache["mtp"])
  e = params["embed"][tokens_BxL].astype(dt)
  h = jnp.concatenate([rms_norm(e, p["enorm"], cfg.rms_norm_eps), rms_norm(h_BxLxD, p["hnorm"], cfg.rms_norm_eps)],
                      axis=-1) @ p["eh_proj"].astype(dt)
  h, c, _ = cached_block(p["block"], h, rope_cos_sin(positions_BxL, cfg), c, start_B, pad_B, valid_BxL, cfg, fresh)
  if isinstance(cache["mtp"], tuple):
    return h, dict(cache, mtp=cache["mtp"][:j] + (c,) + cache["mtp"][j + 1:])
  return h, dict(cache, mtp=jax.tree.map(lambda a, u: a.at[j].set(u), cache["mtp"], c))


def mtp_logits(params: dict, j: int, h_BxLxD: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Logits [B, L, V] f32 of NextN module j from its hidden."""
  dt = jnp.dtype(cfg.compute_dtype)
  p_norm = params["mtp"][j]["norm"] if isinstance(params["mtp"], tuple) else params["mtp"]["norm"][j]
  return (rms_norm(h_BxLxD, p_norm, cfg.rms_norm_eps) @ lm_head(params, cfg).astype(dt)).astype(jnp.float32)


def mtp_cached(params: dict, h_BxLxD: jax.Array, next_tokens_BxL: jax.Array, cache: dict, start_B, pad_B,
               cfg: ModelConfig, fresh: bool = False):
  """The NextN modules at slots start_B..: module 0 combines the trunk hidden at t with token t+1, module j the
  previous module's hidden with token t+1+j (`next_tokens_BxL` is [n, B, L] of those tokens; the first n <= N
  modules run).

  Returns:
    (logits [n, B, L, V] f32, new cache); entry j at slot t predicts the token at t+2+j.
  """
  h, logits = h_BxLxD, []
  for j in range(next_tokens_BxL.shape[0]):
    h, cache = mtp_module(params, j, h, next_tokens_BxL[j], cache, start_B, pad_B, cfg, fresh)
    logits.append(mtp_logits(params, j, h, cfg))
  return jnp.stack(logits), cache
