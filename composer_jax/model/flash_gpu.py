"""Self-attention on GPU through jax's Pallas (Triton) flash-attention kernel (`pallas.ops.gpu.attention.mha`).

The kernel takes segment ids and a causal flag, not a mask, and one head dim for q, k and v. `attend_pallas`
adapts MLA's self-attention to it: the segment id of query l is the first key its mask row shows (for a
segment-causal mask, the first token of l's segment; for the engine's left-padded prefill mask, the first real
token), a row that sees nothing gets an id of its own and a zero output; values are zero-padded to Q = Qn + R dims
and the padding sliced off; L is padded at the end to a power of two (Triton's lowering needs the whole key
sequence, one block of the kernel, to be one) and whole blocks; causality hides the padded keys. This is exact
for masks of the form "same segment and key <= query" (`segment_causal_mask`, `sampling.cached_model.cache_mask`
with a fresh cache), the only masks self-attention receives.

The kernel lowers for cuda on a CPU-only machine and runs in Pallas' interpreter (tests); it has not been compiled
or timed on a GPU here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.gpu import attention as pallas_attention


def segment_ids_from_mask(mask_BxLxL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(segment ids [B, L] int32, row sees something [B, L] bool) of a segment-causal mask."""
  seen_BxL = mask_BxLxL.any(-1)
  first_BxL = jnp.argmax(mask_BxLxL, axis=-1).astype(jnp.int32)
  own_L = -1 - jnp.arange(mask_BxLxL.shape[1], dtype=jnp.int32)   # sees only itself, and is zeroed below
  return jnp.where(seen_BxL, first_BxL, own_L[None]), seen_BxL


def attend_pallas(q_BxLxHxQ: jax.Array, k_BxLxHxQ: jax.Array, v_BxLxHxDv: jax.Array, mask_BxLxL: jax.Array,
                  scale: float, block: int = 128, interpret: bool = False) -> jax.Array:
  """Causal segment self-attention → [B, L, H, Dv] with the Pallas flash kernel (forward and backward kernels)."""
  B, L, H, Q = q_BxLxHxQ.shape
  Dv = v_BxLxHxDv.shape[-1]
  if Dv > Q:
    raise ValueError(f"attend_pallas pads values to the query/key head dim: needs Dv <= Q, got {Dv=} {Q=}")
  seg_BxL, seen_BxL = segment_ids_from_mask(mask_BxLxL)
  Lp = max(pl.next_power_of_2(L), block)
  block = min(block, Lp)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, Lp - L)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  v = jnp.pad(v_BxLxHxDv, [(0, 0), (0, 0), (0, 0), (0, Q - Dv)])
  seg = jnp.concatenate([seg_BxL, jnp.broadcast_to(-1 - jnp.arange(L, Lp, dtype=jnp.int32), (B, Lp - L))], axis=1)
  sizes = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=min(32, block),
                                      block_kv_dkv=min(32, block), block_q_dq=min(32, block),
                                      block_kv_dq=min(32, block))
  out = pallas_attention.mha(pad(q_BxLxHxQ), pad(k_BxLxHxQ), pad(v), seg, sm_scale=scale, causal=True,
                             block_sizes=sizes, interpret=interpret)
  return jnp.where(seen_BxL[:, :, None, None], out[:, :L, :, :Dv], 0).astype(q_BxLxHxQ.dtype)
