"""Multi-head latent attention (MLA) as in DeepSeek-V3, with packed-sequence masking.

`attention(..., cache=None)` is the one MLA layer training and decoding share. `latent_kv` gives what MLA caches
(the normed latent `c` and the rotated shared rope key `kr`: C + R numbers per token and layer instead of
H·(Q + Dv)), `expand_kv` turns latents into per-head keys/values, `queries` builds the queries, `attend` is masked
softmax attention with its own memory-light VJP (`attend_reference`, the plain formula, beside it) and
`attend_latent` the same over cached latents with k_b folded into the query and v_b applied after the softmax
("absorbed" MLA: keys and values are never expanded). `attend_tiled` is the tiled attention of tiled_attention.py
with the causal pairs only; `cfg.attention_kernel` picks it or `attend` for self-attention (`resolve_kernel`).

Letters: B batch, L query length, S key length (cache slots), D hidden, H heads, Qn nope head dim, R rope head dim,
Q = Qn + R, Dv value head dim, C kv_lora_rank.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from composer_jax.model.config import ModelConfig
from composer_jax.model.flash_gpu import attend_pallas
from composer_jax.model.layers import rms_norm
from composer_jax.model.rope import apply_rope, softmax_scale
from composer_jax.model.tiled_attention import Tiling, tile_pairs, tiled_attend


def queries(p: dict, x_BxLxD: jax.Array, cos: jax.Array, sin: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Queries [B, L, H, Q]: nope part then rotated rope part (low-rank through q_a/q_b when q_lora_rank is set)."""
  dt = x_BxLxD.dtype
  if "q" in p:
    q_BxLxHxQ = jnp.einsum("bld,dhq->blhq", x_BxLxD, p["q"].astype(dt))
  else:
    cq_BxLxRq = rms_norm(x_BxLxD @ p["q_a"].astype(dt), p["q_a_norm"], cfg.rms_norm_eps)
    q_BxLxHxQ = jnp.einsum("blr,rhq->blhq", cq_BxLxRq, p["q_b"].astype(dt))
  q_nope, q_rope = q_BxLxHxQ[..., :cfg.qk_nope_head_dim], q_BxLxHxQ[..., cfg.qk_nope_head_dim:]
  return jnp.concatenate([q_nope, apply_rope(q_rope, cos, sin, cfg.rope_interleave)], axis=-1)


def latent_kv(p: dict, x_BxLxD: jax.Array, cos: jax.Array, sin: jax.Array,
              cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """What MLA caches: the normed KV latent c [B, L, C] and the rotated shared rope key kr [B, L, R]."""
  dt = x_BxLxD.dtype
  c_BxLxC = rms_norm(x_BxLxD @ p["kv_a"].astype(dt), p["kv_a_norm"], cfg.rms_norm_eps)
  kr_BxLxR = apply_rope(x_BxLxD @ p["k_rope"].astype(dt), cos, sin, cfg.rope_interleave)
  return c_BxLxC, kr_BxLxR


def expand_kv(p: dict, c_BxSxC: jax.Array, kr_BxSxR: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-head keys [B, S, H, Q] (nope from the latent, rope key shared by all heads) and values [B, S, H, Dv]."""
  dt = c_BxSxC.dtype
  k_nope_BxSxHxQn = jnp.einsum("bsc,chn->bshn", c_BxSxC, p["k_b"].astype(dt))
  v_BxSxHxDv = jnp.einsum("bsc,chv->bshv", c_BxSxC, p["v_b"].astype(dt))
  H = k_nope_BxSxHxQn.shape[2]
  kr_BxSxHxR = jnp.broadcast_to(kr_BxSxR[:, :, None, :], kr_BxSxR.shape[:2] + (H, kr_BxSxR.shape[-1]))
  return jnp.concatenate([k_nope_BxSxHxQn, kr_BxSxHxR], axis=-1), v_BxSxHxDv


def segment_causal_mask(q_segment_ids_BxL: jax.Array, kv_segment_ids_BxS: jax.Array,
                        q_offset: int = 0) -> jax.Array:
  """[B, L, S] bool: key s is visible to query l iff s <= l + q_offset and both lie in the same segment."""
  L, S = q_segment_ids_BxL.shape[1], kv_segment_ids_BxS.shape[1]
  causal_LxS = jnp.arange(S)[None, :] <= (jnp.arange(L) + q_offset)[:, None]
  same_BxLxS = q_segment_ids_BxL[:, :, None] == kv_segment_ids_BxS[:, None, :]
  return same_BxLxS & causal_LxS[None]


def branch_mask(branch_BxL: jax.Array, branch_end_BxL: jax.Array) -> jax.Array:
  """[B, L, L] bool for rows that hold a tree's branches after their shared prefix (`rl.batch`, share_prefix):
  key s is visible to query l iff branch[l] < branch_end[s] — the key's token is in the stream of l's branch (its
  own tokens, or a prefix that branch shares). AND it with `segment_causal_mask`; 0 and 1 everywhere is no
  restriction."""
  return branch_BxL[:, :, None] < branch_end_BxL[:, None, :]


def attend_reference(q_BxLxHxQ: jax.Array, k_BxSxHxQ: jax.Array, v_BxSxHxDv: jax.Array, mask_BxLxS: jax.Array,
                     scale: float) -> jax.Array:
  """The plain formula `attend` computes: masked softmax attention (float32 softmax) → [B, L, H, Dv]; a fully
  masked row gives zeros, not NaN. Its autodiff keeps the [B, H, L, S] probabilities and three masking passes."""
  logits_BxHxLxS = jnp.einsum("blhq,bshq->bhls", q_BxLxHxQ, k_BxSxHxQ,
                              preferred_element_type=jnp.float32) * scale
  logits_BxHxLxS = jnp.where(mask_BxLxS[:, None], logits_BxHxLxS, -jnp.inf)
  probs = jax.nn.softmax(logits_BxHxLxS, axis=-1, where=mask_BxLxS[:, None])
  probs = jnp.where(mask_BxLxS[:, None], probs, 0.0).astype(v_BxSxHxDv.dtype)
  return jnp.einsum("bhls,bshv->blhv", probs, v_BxSxHxDv)


def _attend_fwd(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask_BxLxS, scale):
  s_BxHxLxS = jnp.einsum("blhq,bshq->bhls", q_BxLxHxQ, k_BxSxHxQ, preferred_element_type=jnp.float32) * scale
  s_BxHxLxS = jnp.where(mask_BxLxS[:, None], s_BxHxLxS, -jnp.inf)
  m_BxHxLx1 = jnp.max(s_BxHxLxS, axis=-1, keepdims=True)
  m_BxHxLx1 = jnp.where(jnp.isfinite(m_BxHxLx1), m_BxHxLx1, 0.0)     # a fully masked row: 0, not -inf
  e_BxHxLxS = jnp.exp(s_BxHxLxS - m_BxHxLx1)                          # masked entries: exp(-inf) = 0
  l_BxHxLx1 = jnp.sum(e_BxHxLxS, axis=-1, keepdims=True)
  l_BxHxLx1 = jnp.where(l_BxHxLx1 > 0, l_BxHxLx1, 1.0)
  p = (e_BxHxLxS / l_BxHxLx1).astype(v_BxSxHxDv.dtype)
  out_BxLxHxDv = jnp.einsum("bhls,bshv->blhv", p, v_BxSxHxDv)
  lse_BxHxLx1 = m_BxHxLx1 + jnp.log(l_BxHxLx1)
  return out_BxLxHxDv, (q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask_BxLxS, out_BxLxHxDv, lse_BxHxLx1)


def _attend_bwd(scale, res, do_BxLxHxDv):
  """Recomputes the probabilities from q, k and the log-normaliser (no [B, H, L, S] residual), then
  dv = pᵀ do, dp = do vᵀ, ds = p ⊙ (dp − rowsum(do ⊙ out)) · scale, dq = ds k, dk = dsᵀ q."""
  q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask_BxLxS, out_BxLxHxDv, lse_BxHxLx1 = res
  s_BxHxLxS = jnp.einsum("blhq,bshq->bhls", q_BxLxHxQ, k_BxSxHxQ, preferred_element_type=jnp.float32) * scale
  p_BxHxLxS = jnp.where(mask_BxLxS[:, None], jnp.exp(s_BxHxLxS - lse_BxHxLx1), 0.0)
  do = do_BxLxHxDv.astype(v_BxSxHxDv.dtype)
  dv_BxSxHxDv = jnp.einsum("bhls,blhv->bshv", p_BxHxLxS.astype(v_BxSxHxDv.dtype), do)
  dp_BxHxLxS = jnp.einsum("blhv,bshv->bhls", do, v_BxSxHxDv, preferred_element_type=jnp.float32)
  delta_BxHxL = jnp.einsum("blhv,blhv->bhl", do, out_BxLxHxDv, preferred_element_type=jnp.float32)
  ds = (p_BxHxLxS * (dp_BxHxLxS - delta_BxHxL[..., None]) * scale).astype(q_BxLxHxQ.dtype)
  dq_BxLxHxQ = jnp.einsum("bhls,bshq->blhq", ds, k_BxSxHxQ)
  dk_BxSxHxQ = jnp.einsum("bhls,blhq->bshq", ds, q_BxLxHxQ)
  return dq_BxLxHxQ, dk_BxSxHxQ.astype(k_BxSxHxQ.dtype), dv_BxSxHxDv, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attend(q_BxLxHxQ: jax.Array, k_BxSxHxQ: jax.Array, v_BxSxHxDv: jax.Array, mask_BxLxS: jax.Array,
           scale: float) -> jax.Array:
  """Masked softmax attention (float32 softmax) → [B, L, H, Dv]; a fully masked row gives zeros, not NaN.

  `attend_reference` with its own VJP: the forward keeps the per-row log-normaliser instead of the [B, H, L, S]
  probabilities and masks once; the backward recomputes them (flash-attention's formulation, unblocked). Measured
  1.34× the reference's forward + backward per colab layer on XLA:CPU (8 × 256 tokens, 4 heads, alternating).
  """
  return _attend_fwd(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask_BxLxS, scale)[0]


attend.defvjp(_attend_fwd, _attend_bwd)


# Tile pairs up to which the tiled loop is unrolled into straight-line code: at the colab and small shapes (L = 256,
# 64-wide tiles: 10 pairs) the unrolled program ran 1.3-1.65x `attend`'s forward + backward, the same pairs under a
# `lax.scan` 1.0-1.4x (model/README.md). Long sequences keep the loop: program size stays flat in L.
UNROLL_PAIRS = 64


def attend_tiled(q_BxLxHxQ: jax.Array, k_BxSxHxQ: jax.Array, v_BxSxHxDv: jax.Array, mask_BxLxS: jax.Array,
                 scale: float, block: int = 64, q_offset: int = 0) -> jax.Array:
  """`attend` tiled, visiting only the tiles on or below the causal line (key s <= query l + q_offset).

  The mask must imply that line (self-attention masks do: `segment_causal_mask`, the engine's `cache_mask`); the
  line is applied as well, so a mask that does not is attended under mask AND causal.
  """
  tiling = Tiling(block_q=block, block_k=block, causal_offset=q_offset)
  n_pairs = len(tile_pairs(q_BxLxHxQ.shape[1], k_BxSxHxQ.shape[1], tiling)[0])
  tiling = dataclasses.replace(tiling, unroll=n_pairs <= UNROLL_PAIRS)
  return tiled_attend(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, (mask_BxLxS,), scale, tiling)


ATTENTION_KERNELS = ("whole", "tiled", "pallas")
# "auto" by platform: XLA:CPU measured the tiled kernel faster at every shape tried (model/README.md); elsewhere the
# whole-block `attend`: the tiled jnp loop and the Pallas kernel ("pallas", GPU only: flash_gpu.py) lower for cuda
# but have not been compiled or timed on a GPU here.
AUTO_ATTENTION_KERNEL = {"cpu": "tiled"}
AUTO_ATTENTION_KERNEL_DEFAULT = "whole"


def resolve_kernel(cfg: ModelConfig, platform: str | None = None) -> str:
  """The kernel `cfg.attention_kernel` stands for: itself, or for "auto" the platform's (default: the backend's)."""
  if cfg.attention_kernel == "auto":
    return AUTO_ATTENTION_KERNEL.get(platform or jax.default_backend(), AUTO_ATTENTION_KERNEL_DEFAULT)
  if cfg.attention_kernel not in ATTENTION_KERNELS:
    raise ValueError(f"attention_kernel={cfg.attention_kernel!r}; valid: {['auto', *ATTENTION_KERNELS]}")
  return cfg.attention_kernel


def self_attend(q_BxLxHxQ: jax.Array, k_BxLxHxQ: jax.Array, v_BxLxHxDv: jax.Array, mask_BxLxL: jax.Array,
                cfg: ModelConfig) -> jax.Array:
  """Causal self-attention of L tokens among themselves with the configured kernel → [B, L, H, Dv]."""
  kernel = resolve_kernel(cfg)
  if kernel == "tiled":
    return attend_tiled(q_BxLxHxQ, k_BxLxHxQ, v_BxLxHxDv, mask_BxLxL, softmax_scale(cfg), cfg.attention_block)
  if kernel == "pallas":
    return attend_pallas(q_BxLxHxQ, k_BxLxHxQ, v_BxLxHxDv, mask_BxLxL, softmax_scale(cfg))
  return attend(q_BxLxHxQ, k_BxLxHxQ, v_BxLxHxDv, mask_BxLxL, softmax_scale(cfg))


def attend_latent(p: dict, q_BxLxHxQ: jax.Array, c_BxSxC: jax.Array, kr_BxSxR: jax.Array, mask_BxLxS: jax.Array,
                  cfg: ModelConfig) -> jax.Array:
  """Absorbed MLA attention over latents → [B, L, H, Dv] (equal to expand_kv + attend)."""
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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["c", "kr", "start_B"],
                   meta_fields=["fresh", "expand"])
@dataclasses.dataclass(frozen=True)
class KVCache:
  """One layer's MLA cache (or a stack's, with a leading layer axis on c and kr) and where new tokens go.

  Attributes:
    c: normed latents [B, S, C].
    kr: rotated rope keys [B, S, R].
    start_B: slot of each row's first new token (rows advance independently: speculative decoding).
    fresh: the cache is empty and start_B is 0: the new tokens attend among themselves through `expand_kv` +
      `self_attend`, exactly the training forward's arithmetic (the mask is then [B, L, L]); otherwise they attend
      over all S slots in latent space (mask [B, L, S]).
    expand: (not fresh) attend over the S slots with expanded keys and values instead, as `fresh` does over the new
      tokens: for a prefill of many new tokens over reused rows, expanding the slots once costs less than the
      absorbed form's per-query latent products (measured 1.4-1.9x faster at 32-128 new tokens over 385 slots,
      `rl_colab`, XLA:CPU); decode steps (one or a few new tokens) stay latent.
  """
  c: jax.Array
  kr: jax.Array
  start_B: jax.Array
  fresh: bool = False
  expand: bool = False


def write_rows(buf_BxSx_: jax.Array, new_BxLx_: jax.Array, start_B: jax.Array) -> jax.Array:
  """Writes new[b] into buf[b] at slot start_B[b] (per-row offsets)."""
  def one(buf, new, s):
    return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), s, axis=0)
  return jax.vmap(one)(buf_BxSx_, new_BxLx_, start_B)


def attention(p: dict, x_BxLxD: jax.Array, cos: jax.Array, sin: jax.Array, mask_BxLxS: jax.Array,
              cfg: ModelConfig, cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
  """MLA self-attention → ([B, L, D], cache with the new tokens' latents written at start_B, or None).

  Without a cache the L tokens attend among themselves ([B, L, L] mask, causal: `self_attend`); with one, see
  `KVCache.fresh`.
  """
  q_BxLxHxQ = queries(p, x_BxLxD, cos, sin, cfg)
  c_BxLxC, kr_BxLxR = latent_kv(p, x_BxLxD, cos, sin, cfg)
  if cache is not None:
    cache = dataclasses.replace(cache, c=write_rows(cache.c, c_BxLxC, cache.start_B),
                                kr=write_rows(cache.kr, kr_BxLxR, cache.start_B))
  if cache is None or cache.fresh:
    k_BxLxHxQ, v_BxLxHxDv = expand_kv(p, c_BxLxC, kr_BxLxR)
    out_BxLxHxDv = self_attend(q_BxLxHxQ, k_BxLxHxQ, v_BxLxHxDv, mask_BxLxS, cfg)
  elif cache.expand:   # a prefill window over reused rows: L new queries over S slots, any mask
    k_BxSxHxQ, v_BxSxHxDv = expand_kv(p, cache.c, cache.kr)
    out_BxLxHxDv = attend(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask_BxLxS, softmax_scale(cfg))
  else:
    out_BxLxHxDv = attend_latent(p, q_BxLxHxQ, cache.c, cache.kr, mask_BxLxS, cfg)
  return jnp.einsum("blhv,hvd->bld", out_BxLxHxDv, p["o"].astype(x_BxLxD.dtype)), cache
