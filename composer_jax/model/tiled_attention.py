"""Tiled (flash-style) masked attention: online softmax over (query tile, key tile) pairs, only the pairs a mask allows.

One implementation for two users: the single-device `attention.attend_tiled` and each block of ring attention
(ring_attention.py). Both want the same two pieces, so they are exposed as such:

- `fold(acc, q, k, v, mask, scale, tiling)` folds one key block into a running online-softmax accumulator
  `(o [B, H, L, Dv], m [B, H, L], l [B, H, L])`, all float32 (the ring calls it once per ring step);
- `block_grads(q, k, v, mask, do, lse, delta, scale, tiling)` returns (dq, dk, dv) in float32 of one key block
  given the final log-normaliser, recomputing each tile's probabilities (the ring's backward calls it per step).

`tiled_attend` is the two glued with a `custom_vjp`: the forward keeps out and the log-sum-exp, never a
[B, H, L, S] array; peak scratch is one [B, H, block_q, block_k] tile (plus the float32 accumulators).

Which pairs are visited is decided statically from `Tiling.causal_offset`: with an offset o, key tile j is visited
for query tile i only if its first key is <= the tile's last query + o (the lower triangle: ~half the pairs at L = S),
so the skipped work is absent from the program. The pairs run under one `lax.scan` (a while loop with in-place
updates of the accumulators), or fully unrolled (`Tiling.unroll`) when there are few of them. `Tiling.skip_empty`
adds a data-dependent skip: a `lax.cond` around every pair whose mask tile is all False across the batch
(packed segments, left padding). Ragged lengths are padded up to whole tiles with masked keys and query rows.

The mask is either dense, `(mask_BxLxS,)`, or built per tile from segments, `(seg_q_BxL, idx_q_BxL, seg_k_BxS,
idx_k_BxS)`: key s is visible to query l iff same segment and idx_k <= idx_q (the ring's form: no [L, S] array).
Either way the causal offset, when set, is applied too (attention under mask AND key <= query + offset).

Letters: B batch, L query length, S key length, H heads, Q query/key head dim, Dv value head dim; tq, tk tile sizes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How one block is tiled (static: hashable, part of the program).

  Attributes:
    block_q, block_k: tile sizes (clipped to L and S).
    causal_offset: None (visit every pair) or o: key s is visible to query l only if s <= l + o, and tile pairs
      entirely above that line are not visited.
    skip_empty: skip, at run time, pairs whose mask tile is all False across the batch.
    unroll: unroll the loop over pairs (few large pairs: lets XLA schedule them as straight-line code).
  """
  block_q: int = 128
  block_k: int = 128
  causal_offset: int | None = 0
  skip_empty: bool = False
  unroll: bool = False

  def __post_init__(self):
    if self.block_q < 1 or self.block_k < 1:
      raise ValueError(f"Tiling block sizes must be positive, got {self.block_q=} {self.block_k=}")


def tile_pairs(L: int, S: int, tiling: Tiling) -> tuple[np.ndarray, np.ndarray, int, int]:
  """(query tile starts, key tile starts, tq, tk) of the visited pairs, query-major."""
  tq, tk = min(tiling.block_q, L), min(tiling.block_k, S)
  qs, ks = np.arange(0, L, tq), np.arange(0, S, tk)
  qi, kj = np.meshgrid(qs, ks, indexing="ij")
  keep = np.ones_like(qi, bool) if tiling.causal_offset is None else kj <= qi + tq - 1 + tiling.causal_offset
  return qi[keep].astype(np.int32), kj[keep].astype(np.int32), tq, tk


def _pad_to(x: jax.Array, axis: int, size: int, value) -> jax.Array:
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _padded(q, k, v, mask, tq: int, tk: int):
  """Pads L and S up to whole tiles; padded keys are never visible and padded queries see nothing."""
  L, S = q.shape[1], k.shape[1]
  Lp, Sp = -(-L // tq) * tq, -(-S // tk) * tk
  q, k, v = _pad_to(q, 1, Lp, 0), _pad_to(k, 1, Sp, 0), _pad_to(v, 1, Sp, 0)
  if len(mask) == 1:
    mask = (_pad_to(_pad_to(mask[0], 1, Lp, False), 2, Sp, False),)
  else:
    seg_q, idx_q, seg_k, idx_k = mask
    big = jnp.iinfo(jnp.int32).max
    mask = (_pad_to(seg_q, 1, Lp, 0), _pad_to(idx_q, 1, Lp, -1), _pad_to(seg_k, 1, Sp, 0), _pad_to(idx_k, 1, Sp, big))
  return q, k, v, mask


def _tile_mask(mask, i0, tq: int, j0, tk: int, tiling: Tiling) -> jax.Array:
  """[B, tq, tk] visibility of the tile at query i0, key j0."""
  sl = jax.lax.dynamic_slice_in_dim
  if len(mask) == 1:
    m = sl(sl(mask[0], i0, tq, 1), j0, tk, 2)
  else:
    seg_q, idx_q, seg_k, idx_k = (sl(a, s, t, 1) for a, s, t in zip(mask, (i0, i0, j0, j0), (tq, tq, tk, tk)))
    m = (seg_q[:, :, None] == seg_k[:, None, :]) & (idx_k[:, None, :] <= idx_q[:, :, None])
  if tiling.causal_offset is not None:
    causal = (j0 + jnp.arange(tk))[None, :] <= (i0 + jnp.arange(tq))[:, None] + tiling.causal_offset
    m = m & causal[None]
  return m


def _logits(q_tile, k_tile, m_BxTqxTk, scale) -> jax.Array:
  s = jnp.einsum("bqhd,bkhd->bhqk", q_tile, k_tile, preferred_element_type=F32) * scale
  return jnp.where(m_BxTqxTk[:, None], s, -jnp.inf)


def _scan_pairs(step, carry, pairs, tiling: Tiling, mask, tq: int, tk: int):
  """Runs step(carry, i0, j0, mask_tile) over the visited pairs (skipping all-False tiles if asked)."""
  def body(carry, ij):
    i0, j0 = ij
    m = _tile_mask(mask, i0, tq, j0, tk, tiling)
    if tiling.skip_empty:
      return jax.lax.cond(m.any(), lambda c: step(c, i0, j0, m), lambda c: c, carry), None
    return step(carry, i0, j0, m), None
  qi, kj = pairs
  carry, _ = jax.lax.scan(body, carry, (jnp.asarray(qi), jnp.asarray(kj)), unroll=len(qi) if tiling.unroll else 1)
  return carry


def empty_acc(B: int, H: int, L: int, Dv: int):
  """A fresh accumulator: nothing seen yet (o = 0, m = -inf, l = 0)."""
  return jnp.zeros((B, H, L, Dv), F32), jnp.full((B, H, L), -jnp.inf, F32), jnp.zeros((B, H, L), F32)


def fold(acc, q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask: tuple, scale: float, tiling: Tiling):
  """Folds keys/values [B, S, ...] into the accumulator over the visited tile pairs → the new accumulator."""
  L, S = q_BxLxHxQ.shape[1], k_BxSxHxQ.shape[1]
  qi, kj, tq, tk = tile_pairs(L, S, tiling)
  q, k, v, mask = _padded(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask, tq, tk)
  Lp = q.shape[1]
  acc = tuple(_pad_to(a, 2, Lp, fill) for a, fill in zip(acc, (0.0, -jnp.inf, 0.0)))
  sl, put = jax.lax.dynamic_slice_in_dim, jax.lax.dynamic_update_slice_in_dim

  def step(acc, i0, j0, m_tile):
    o, m, l = acc
    s = _logits(sl(q, i0, tq, 1), sl(k, j0, tk, 1), m_tile, scale)
    m_old, l_old, o_old = sl(m, i0, tq, 2), sl(l, i0, tq, 2), sl(o, i0, tq, 2)
    # The max only stabilises exp; nothing depends on its value, so it carries no gradient.
    m_new = jnp.maximum(m_old, jax.lax.stop_gradient(s.max(-1)))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)   # rows with nothing visible yet: exp(-inf - 0) = 0
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m_old - m_safe)
    pv = jnp.einsum("bhqk,bkhv->bhqv", p.astype(v.dtype), sl(v, j0, tk, 1), preferred_element_type=F32)
    return (put(o, alpha[..., None] * o_old + pv, i0, 2), put(m, m_new, i0, 2),
            put(l, alpha * l_old + p.sum(-1), i0, 2))

  acc = _scan_pairs(step, acc, (qi, kj), tiling, mask, tq, tk)
  return tuple(a[:, :, :L] for a in acc)


def finish(acc, dtype) -> tuple[jax.Array, jax.Array]:
  """(out [B, L, H, Dv] in dtype, lse [B, H, L] float32) of an accumulator; rows that saw no key: 0 and -inf."""
  o, m, l = acc
  seen = l > 0
  out = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
  return out.transpose(0, 2, 1, 3).astype(dtype), lse


def block_grads(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask: tuple, do_BxLxHxDv, lse_BxHxL, delta_BxHxL, scale: float,
                tiling: Tiling):
  """(dq [B, L, H, Q], dk [B, S, H, Q], dv [B, S, H, Dv]), float32, of one key block.

  With p = exp(s - lse) recomputed per tile: dv = pᵀ do, dp = do vᵀ, ds = p ⊙ (dp − delta) · scale, dq = ds k,
  dk = dsᵀ q, where delta = rowsum(do ⊙ out) of the final output (flash-attention's backward).
  """
  L, S = q_BxLxHxQ.shape[1], k_BxSxHxQ.shape[1]
  qi, kj, tq, tk = tile_pairs(L, S, tiling)
  q, k, v, mask = _padded(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask, tq, tk)
  Lp = q.shape[1]
  do = _pad_to(do_BxLxHxDv.astype(v.dtype), 1, Lp, 0)
  lse = _pad_to(jnp.where(jnp.isfinite(lse_BxHxL), lse_BxHxL, 0.0), 2, Lp, 0.0)
  delta = _pad_to(delta_BxHxL, 2, Lp, 0.0)
  sl = jax.lax.dynamic_slice_in_dim

  def add(x, tile, start):
    return jax.lax.dynamic_update_slice_in_dim(x, sl(x, start, tile.shape[1], 1) + tile, start, 1)

  def step(grads, i0, j0, m_tile):
    dq, dk, dv = grads
    q_t, k_t, v_t, do_t = sl(q, i0, tq, 1), sl(k, j0, tk, 1), sl(v, j0, tk, 1), sl(do, i0, tq, 1)
    s = _logits(q_t, k_t, m_tile, scale)
    p = jnp.where(m_tile[:, None], jnp.exp(s - sl(lse, i0, tq, 2)[..., None]), 0.0)
    dp = jnp.einsum("bqhv,bkhv->bhqk", do_t, v_t, preferred_element_type=F32)
    ds = (p * (dp - sl(delta, i0, tq, 2)[..., None]) * scale).astype(q.dtype)
    dv_t = jnp.einsum("bhqk,bqhv->bkhv", p.astype(v.dtype), do_t, preferred_element_type=F32)
    dq_t = jnp.einsum("bhqk,bkhd->bqhd", ds, k_t, preferred_element_type=F32)
    dk_t = jnp.einsum("bhqk,bqhd->bkhd", ds, q_t, preferred_element_type=F32)
    return add(dq, dq_t, i0), add(dk, dk_t, j0), add(dv, dv_t, j0)

  # zeros_like keeps the inputs' varying-ness inside a shard_map (the ring), which the skip's cond branches need.
  grads = (jnp.zeros_like(q, F32), jnp.zeros_like(k, F32), jnp.zeros_like(v, F32))
  dq, dk, dv = _scan_pairs(step, grads, (qi, kj), tiling, mask, tq, tk)
  return dq[:, :L], dk[:, :S], dv[:, :S]


def _check(q, k, v, mask):
  B, L, H, Q = q.shape
  S = k.shape[1]
  if k.shape != (B, S, H, Q) or v.shape[:3] != (B, S, H):
    raise ValueError(f"tiled_attend: q {q.shape}, k {k.shape}, v {v.shape} must be [B, L, H, Q], [B, S, H, Q], "
                     "[B, S, H, Dv]")
  want = [(B, L, S)] if len(mask) == 1 else [(B, L), (B, L), (B, S), (B, S)]
  if [tuple(m.shape) for m in mask] != want:
    raise ValueError(f"tiled_attend: mask shapes {[tuple(m.shape) for m in mask]} must be {want} "
                     "((mask,) or (seg_q, idx_q, seg_k, idx_k))")


def delta_rows(do_BxLxHxDv, out_BxLxHxDv) -> jax.Array:
  """rowsum(do ⊙ out) [B, H, L] float32: the backward's correction term."""
  return jnp.einsum("blhv,blhv->bhl", do_BxLxHxDv, out_BxLxHxDv, preferred_element_type=F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def tiled_attend(q_BxLxHxQ: jax.Array, k_BxSxHxQ: jax.Array, v_BxSxHxDv: jax.Array, mask: tuple, scale: float,
                 tiling: Tiling = Tiling()) -> jax.Array:
  """Masked softmax attention (float32 softmax) → [B, L, H, Dv], tiled; a fully masked row gives zeros.

  Args:
    q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv: queries, keys, values (Q may differ from Dv, as in MLA).
    mask: `(mask_BxLxS,)` or `(seg_q_BxL, idx_q_BxL, seg_k_BxS, idx_k_BxS)` (see the module docstring).
    scale: softmax scale.
    tiling: tile sizes, causal offset (static skipping), data-dependent skipping, unrolling.
  """
  return _tiled_fwd(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, mask, scale, tiling)[0]


def _tiled_fwd(q, k, v, mask, scale, tiling):
  _check(q, k, v, mask)
  acc = fold(empty_acc(q.shape[0], q.shape[2], q.shape[1], v.shape[3]), q, k, v, mask, scale, tiling)
  out, lse = finish(acc, q.dtype)
  return out, (q, k, v, mask, out, lse)


def _tiled_bwd(scale, tiling, res, do):
  q, k, v, mask, out, lse = res
  dq, dk, dv = block_grads(q, k, v, mask, do, lse, delta_rows(do, out), scale, tiling)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), tuple(None for _ in mask)


tiled_attend.defvjp(_tiled_fwd, _tiled_bwd)
