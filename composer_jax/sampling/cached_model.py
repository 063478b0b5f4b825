"""The model run incrementally over an MLA KV cache: slot bookkeeping around the model's own layers.

The layers are the model's (`transformer.run_stack` / `mtp_block` with `cache=`, `attention.KVCache`); this file
only lays out the cache, maps slots to positions and masks, and applies the final norms and the LM head. Per token
and layer the cache holds C + R numbers (colab: 64 + 16) instead of H·(Q + Dv) for expanded keys and values
(colab: 4·(48 + 32) = 320): DeepSeek-V3's MLA memory saving. Decode attends in latent space; prefill from an empty
cache (`fresh`) uses the expanded path, exactly as the trainer's forward.

Slots: row b's prompt is left-padded, `pad_B[b]` padding slots first; slot s holds RoPE position s - pad_B[b]. A
query at slot q sees keys at slots pad_B[b] <= s <= q, so stale entries past a row's pointer (rejected drafts) are
never read before being overwritten. Every row has its own write pointer `start_B` (speculative decoding accepts a
different number of tokens per row).

Letters: B batch, L new tokens, S cache slots, D hidden, V vocab, C kv_lora_rank, R rope head dim, K experts per
token, Lm MoE layers, Ls layers of a stack.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.model.attention import KVCache, write_rows
from composer_jax.model.config import ModelConfig
from composer_jax.model.head import lm_head, logits
from composer_jax.model.layers import rms_norm
from composer_jax.model.rope import rope_cos_sin
from composer_jax.model.transformer import mtp_block, run_stack, take_layer

STACKS = ("dense_layers", "moe_layers")
__all__ = ["STACKS", "cache_mask", "forward_cached", "init_cache", "mtp_cached", "mtp_logits", "mtp_module",
           "slot_info", "split_layers", "write_rows"]


def init_cache(params: dict, cfg: ModelConfig, batch: int, slots: int) -> dict:
  """Zeroed cache: for each layer stack (and `mtp`), c [Ls, B, S, C] and kr [Ls, B, S, R] in the compute dtype."""
  dt = jnp.dtype(cfg.compute_dtype)
  cache = {}
  for name in (*STACKS, "mtp"):
    if name in params:
      n = jax.tree.leaves(params[name])[0].shape[0]
      cache[name] = {"c": jnp.zeros((n, batch, slots, cfg.kv_lora_rank), dt),
                     "kr": jnp.zeros((n, batch, slots, cfg.qk_rope_head_dim), dt)}
  return cache


def slot_info(start_B: jax.Array, pad_B: jax.Array, L: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(slots [B, L], RoPE positions [B, L], valid [B, L]) of L new tokens written at start_B."""
  slots_BxL = start_B[:, None] + jnp.arange(L, dtype=jnp.int32)[None, :]
  valid_BxL = slots_BxL >= pad_B[:, None]
  return slots_BxL, jnp.where(valid_BxL, slots_BxL - pad_B[:, None], 0), valid_BxL


def cache_mask(slots_BxL: jax.Array, pad_B: jax.Array, S: int) -> jax.Array:
  """[B, L, S]: slot s visible to the query at slot q iff pad <= s <= q."""
  s_S = jnp.arange(S, dtype=jnp.int32)
  return (s_S[None, None, :] <= slots_BxL[:, :, None]) & (s_S[None, None, :] >= pad_B[:, None, None])


def split_layers(tree: dict) -> dict:
  """Params or cache with each layer stack (and `mtp`) as a tuple of per-layer trees instead of [Ls, ...] arrays.

  Decode steps run the layers of a split stack as an unrolled loop: inside a `lax.scan` every layer's weights were
  dynamic-sliced out of the stack on each step, a copy that cost more than the layers' matmuls on CPU at batch 1.
  Split once per generation call, outside the decode loop.
  """
  out = dict(tree)
  for name in (*STACKS, "mtp"):
    if name in tree and not isinstance(tree[name], tuple):
      n = jax.tree.leaves(tree[name])[0].shape[0]
      out[name] = tuple(take_layer(tree[name], i) for i in range(n))
  return out


def _kv(stack_cache, start_B, fresh: bool, expand: bool) -> KVCache:
  """A stack's cache (stacked {c, kr} or a split tuple of them) as the model's KVCache."""
  if isinstance(stack_cache, tuple):
    return KVCache(tuple(c["c"] for c in stack_cache), tuple(c["kr"] for c in stack_cache), start_B, fresh, expand)
  return KVCache(stack_cache["c"], stack_cache["kr"], start_B, fresh, expand)


def _unkv(cache: KVCache):
  if isinstance(cache.c, tuple):
    return tuple({"c": c, "kr": kr} for c, kr in zip(cache.c, cache.kr))
  return {"c": cache.c, "kr": cache.kr}


def _attention_inputs(start_B, pad_B, L: int, S: int, cfg: ModelConfig, fresh: bool):
  """(rope, mask, valid) of L new tokens at slots start_B..: a fresh prefill attends among its L tokens only."""
  slots_BxL, positions_BxL, valid_BxL = slot_info(start_B, pad_B, L)
  return rope_cos_sin(positions_BxL, cfg), cache_mask(slots_BxL, pad_B, L if fresh else S), valid_BxL


def forward_cached(params: dict, tokens_BxL: jax.Array, cache: dict, start_B: jax.Array, pad_B: jax.Array,
                   cfg: ModelConfig, fresh: bool = False, last_logits: bool = False, expand: bool = False):
  """Runs the trunk on L new tokens at slots start_B.., reading and updating the cache.

  `expand`: attend over the cache with expanded keys and values (`KVCache.expand`: a prefill window over reused
  rows), not in latent space.

  `last_logits`: only the last position's logits ([B, 1, V]; a prefill samples from nothing else, and the head over
  every prompt position cost as much as a small model's layers).

  Returns:
    (logits [B, L or 1, V] f32, last hidden before the final norm [B, L, D] (the MTP input), experts int32
    [Lm, B, L, K], new cache).
  """
  B, L = tokens_BxL.shape
  dt = jnp.dtype(cfg.compute_dtype)
  S = jax.tree.leaves(cache)[0].shape[-2]
  rope, mask, valid_BxL = _attention_inputs(start_B, pad_B, L, S, cfg, fresh)
  x = params["embed"][tokens_BxL].astype(dt)
  new_cache = dict(cache)
  experts = jnp.zeros((0, B, L, cfg.num_experts_per_tok), jnp.int32)
  for name in STACKS:
    if name in params:
      kv = _kv(cache[name], start_B, fresh, expand)
      x, aux, kv = run_stack(params[name], x, rope, mask, valid_BxL, cfg, cache=kv)
      new_cache[name] = _unkv(kv)
      if "experts" in aux:
        experts = aux["experts"]
  x_out = x[:, -1:] if last_logits else x
  return logits(rms_norm(x_out, params["final_norm"], cfg.rms_norm_eps), lm_head(params, cfg)), x, experts, new_cache


def mtp_module(params: dict, j: int, h_BxLxD: jax.Array, tokens_BxL: jax.Array, cache: dict, start_B, pad_B,
               cfg: ModelConfig, fresh: bool = False, expand: bool = False) -> tuple[jax.Array, dict]:
  """NextN module j at slots start_B..: combines hidden h_t with the token at t+1+j → (its hidden [B, L, D] before
  the module's final norm, new cache)."""
  dt = jnp.dtype(cfg.compute_dtype)
  S = jax.tree.leaves(cache["mtp"])[0].shape[-2]
  rope, mask, valid_BxL = _attention_inputs(start_B, pad_B, h_BxLxD.shape[1], S, cfg, fresh)
  c = take_layer(cache["mtp"], j)
  e_BxLxD = params["embed"][tokens_BxL].astype(dt)
  h, _, kv = mtp_block(take_layer(params["mtp"], j), h_BxLxD, e_BxLxD, rope, mask, valid_BxL, cfg,
                       KVCache(c["c"], c["kr"], start_B, fresh, expand))
  c = {"c": kv.c, "kr": kv.kr}
  if isinstance(cache["mtp"], tuple):
    return h, dict(cache, mtp=cache["mtp"][:j] + (c,) + cache["mtp"][j + 1:])
  return h, dict(cache, mtp=jax.tree.map(lambda a, u: a.at[j].set(u), cache["mtp"], c))


def mtp_logits(params: dict, j: int, h_BxLxD: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Logits [B, L, V] f32 of NextN module j from its hidden."""
  return logits(rms_norm(h_BxLxD, take_layer(params["mtp"], j)["norm"], cfg.rms_norm_eps), lm_head(params, cfg))


def mtp_cached(params: dict, h_BxLxD: jax.Array, next_tokens_BxL: jax.Array, cache: dict, start_B, pad_B,
               cfg: ModelConfig, fresh: bool = False):
  """The NextN modules at slots start_B..: module 0 combines the trunk hidden at t with token t+1, module j the
  previous module's hidden with token t+1+j (`next_tokens_BxL` is [n, B, L] of those tokens; the first n <= N
  modules run).

  Returns:
    (logits [n, B, L, V] f32, new cache); entry j at slot t predicts the token at t+2+j.
  """
  h, out = h_BxLxD, []
  for j in range(next_tokens_BxL.shape[0]):
    h, cache = mtp_module(params, j, h, next_tokens_BxL[j], cache, start_B, pad_B, cfg, fresh)
    out.append(mtp_logits(params, j, h, cfg))
  return jnp.stack(out), cache
