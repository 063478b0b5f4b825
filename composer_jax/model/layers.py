"""Small shared pieces: RMSNorm and the SwiGLU MLP. Letters: B batch, L length, D hidden, F ffw."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32 and cast back before the scale (as HF DeepseekV3RMSNorm)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype) * w.astype(x.dtype).reshape((1,) * (x.ndim - 1) + w.shape)


def mlp(p: dict, x_BxLxD: jax.Array) -> jax.Array:
  """SwiGLU: down(silu(x @ gate) * (x @ up))."""
  dt = x_BxLxD.dtype
  h_BxLxF = jax.nn.silu(x_BxLxD @ p["gate"].astype(dt)) * (x_BxLxD @ p["up"].astype(dt))
  return h_BxLxF @ p["down"].astype(dt)
