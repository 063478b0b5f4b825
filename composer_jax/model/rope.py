"""RoPE with DeepSeek-V3's YaRN scaling, matching Hugging Face transformers' numerics and layout.

Letters: B batch, L length, R qk_rope_head_dim.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.model.config import ModelConfig


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """Returns (inv_freq [R/2] float32, factor multiplying cos/sin), as HF `_compute_yarn_parameters`.

  The cos/sin factor follows HF: get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) when both are non-zero,
  else get_mscale(f). (With DeepSeek-V3 / Kimi K2's mscale == mscale_all_dim it is 1.)
  """
  dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
  # float32 like torch, so the angles agree to the last bit at long positions.
  pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  rs = cfg.rope_scaling
  if rs is None:
    return (1.0 / pos_freqs).astype(np.float32), 1.0
  f = rs.factor
  if rs.mscale and rs.mscale_all_dim:
    attention_factor = yarn_get_mscale(f, rs.mscale) / yarn_get_mscale(f, rs.mscale_all_dim)
  else:
    attention_factor = yarn_get_mscale(f)

  def correction_dim(n_rot):
    return dim * math.log(rs.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

  low = max(math.floor(correction_dim(rs.beta_fast)), 0)
  high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
  if low == high:
    high += 0.001  # as HF: avoid a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
  extrapolation = 1 - ramp
  inv_extra = 1.0 / pos_freqs
  inv_inter = 1.0 / (np.float32(f) * pos_freqs)
  inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
  return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
  """1/sqrt(qk_head_dim), times get_mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V3's correction)."""
  scale = cfg.qk_head_dim ** -0.5
  rs = cfg.rope_scaling
  if rs is not None and rs.mscale_all_dim:
    m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
    scale = scale * m * m
  return scale


def rope_cos_sin(positions_BxL: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, L, R/2] in float32 (already multiplied by the YaRN attention factor)."""
  inv_freq, factor = inv_freq_and_attention_factor(cfg)
  angles_BxLxR2 = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
  return jnp.cos(angles_BxLxR2) * factor, jnp.sin(angles_BxLxR2) * factor


def apply_rope(x_BxLx_xR: jax.Array, cos_BxLxR2: jax.Array, sin_BxLxR2: jax.Array, interleave: bool) -> jax.Array:
  """Rotates the last dim of x [B, L, ..., R]; cos/sin broadcast over the dims between L and R.

  `interleave=True` rotates pairs (x0, x1), (x2, x3), ... and writes the result de-interleaved
  ([rotated evens, rotated odds]), bit-compatible with HF `apply_rotary_pos_emb_interleave` (queries and keys are
  permuted alike, so q.k is unchanged). `interleave=False` rotates (x_i, x_{i+R/2}) pairs (HF `rotate_half`).
  """
  extra = x_BxLx_xR.ndim - 3
  cos = cos_BxLxR2.reshape(cos_BxLxR2.shape[:2] + (1,) * extra + cos_BxLxR2.shape[2:])
  sin = sin_BxLxR2.reshape(sin_BxLxR2.shape[:2] + (1,) * extra + sin_BxLxR2.shape[2:])
  x = x_BxLx_xR.astype(jnp.float32)
  if interleave:
    x1, x2 = x[..., 0::2], x[..., 1::2]
  else:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLx_xR.dtype)
