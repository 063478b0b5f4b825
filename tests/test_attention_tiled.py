"""tiled_attention.tiled_attend (and attention.attend_tiled) against attend_reference: values and gradients.

Tolerances: float32 computes the same sums in another order (online softmax, per-tile rescaling), so the gaps are
rounding (~1e-6 on O(1) outputs; 1e-5 allowed). bfloat16 rounds the probabilities before the value matmul in both,
but at different points (the reference after normalising, the tiled kernel before), each a relative 2^-8 = 4e-3,
summed over up to 40 keys of O(1) values: 3e-2 allowed, as for `attend`. A wrong mask or tile is an O(1) error.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.model import ModelConfig
from composer_jax.model.attention import (
  attend_reference,
  attend_tiled,
  resolve_kernel,
  segment_causal_mask,
  self_attend,
)
from composer_jax.model.tiled_attention import Tiling, tile_pairs, tiled_attend

B, L, H, Q, DV = 2, 37, 3, 12, 8     # MLA-like: Q != Dv; L = 37 leaves partial tiles for every tile size used


def _qkvw(L_q: int, S: int, dtype):
  ks = jax.random.split(jax.random.key(0), 4)
  shapes = [(B, L_q, H, Q), (B, S, H, Q), (B, S, H, DV), (B, L_q, H, DV)]
  q, k, v, w = (jax.random.normal(ks[i], s) for i, s in enumerate(shapes))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), w


def _packed(length: int) -> jax.Array:
  """Row 0: three documents then padding (segment 0); row 1: one document."""
  row0 = np.concatenate([np.full(10, 1), np.full(15, 2), np.full(length - 31, 3), np.zeros(6)])
  return jnp.asarray(np.stack([row0, np.ones(length)]), jnp.int32)


def _check(f, mask, q, k, v, w, tol, scale=0.3):
  """f(q, k, v) against attend_reference under `mask`: output, and grads of sum(out * w) in q, k, v."""
  def loss(g):
    return lambda q, k, v: jnp.sum(g(q, k, v).astype(jnp.float32) * w)
  ref_f = lambda q, k, v: attend_reference(q, k, v, mask, scale)  # noqa: E731
  out, ref = jax.jit(f)(q, k, v), ref_f(q, k, v)
  assert out.dtype == ref.dtype == q.dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
  got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(ref_f), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(got, want, strict=True):
    assert g.dtype == q.dtype and np.isfinite(np.asarray(g, np.float32)).all()
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=tol, atol=tol)
  return out, got


CASES = [(Tiling(8, 8), "dense"), (Tiling(8, 8), "segments"), (Tiling(16, 8, unroll=True), "dense"),
         (Tiling(8, 16, skip_empty=True), "segments"), (Tiling(64, 64), "dense"),
         (Tiling(8, 8, causal_offset=None, skip_empty=True), "segments")]


@pytest.mark.parametrize("tiling, form", CASES, ids=["8x8-dense", "8x8-segments", "16x8-unrolled", "8x16-skip",
                                                      "one-tile", "no-static-skip"])
def test_packed_causal_f32(tiling, form):
  q, k, v, w = _qkvw(L, L, jnp.float32)
  seg = _packed(L)
  mask = segment_causal_mask(seg, seg)
  idx = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  arg = (mask,) if form == "dense" else (seg, idx, seg, idx)
  _check(lambda q, k, v: tiled_attend(q, k, v, arg, 0.3, tiling), mask, q, k, v, w, 1e-5)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_left_padding_and_empty_rows(dtype, tol):
  """The engine's fresh-prefill mask (pad <= s <= l): padded query rows see nothing and give zeros, no NaN."""
  q, k, v, w = _qkvw(L, L, dtype)
  pad = jnp.array([5, 0])
  s = jnp.arange(L)
  mask = (s[None, None, :] <= s[None, :, None]) & (s[None, None, :] >= pad[:, None, None])
  out, grads = _check(lambda q, k, v: attend_tiled(q, k, v, mask, 0.3, block=16), mask, q, k, v, w, tol)
  np.testing.assert_array_equal(np.asarray(out[0, :5], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(grads[0][0, :5], np.float32), 0.0)   # masked queries get no gradient
  np.testing.assert_array_equal(np.asarray(grads[1][0, :5], np.float32), 0.0)   # nor do keys no one sees


# bf16 in the default run: test_left_padding_and_empty_rows above
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), pytest.param(jnp.bfloat16, 3e-2, marks=pytest.mark.slow)])
def test_queries_after_a_prefix(dtype, tol):
  """L != S: 9 new queries after a 28-token prefix (q_offset = 28), packed segments on both sides."""
  S, Lq = L, 9
  q, k, v, w = _qkvw(Lq, S, dtype)
  seg = _packed(S)
  mask = segment_causal_mask(seg[:, S - Lq:], seg, q_offset=S - Lq)
  _check(lambda q, k, v: attend_tiled(q, k, v, mask, 0.3, block=8, q_offset=S - Lq), mask, q, k, v, w, tol)


def test_causal_line_is_applied_with_a_full_mask():
  """A mask that does not imply causality is attended under mask AND causal (the documented contract)."""
  q, k, v, w = _qkvw(L, L, jnp.float32)
  full = jnp.ones((B, L, L), bool)
  _check(lambda q, k, v: attend_tiled(q, k, v, full, 0.3, block=8), full & jnp.tril(full), q, k, v, w, 1e-5)


def test_tile_pairs_by_hand():
  # 4 query tiles x 4 key tiles of 8, causal: the lower triangle, 10 pairs, query-major.
  qi, kj, tq, tk = tile_pairs(32, 32, Tiling(8, 8))
  assert (tq, tk) == (8, 8)
  assert list(zip(qi.tolist(), kj.tolist())) == [(0, 0), (8, 0), (8, 8), (16, 0), (16, 8), (16, 16), (24, 0),
                                                  (24, 8), (24, 16), (24, 24)]
  # 2 query tiles of 8 after a 16-key prefix (offset 16) over 32 keys in tiles of 16: query tile 0 (rows 0-7,
  # last sees key 23) visits key tiles 0 and 16; query tile 8 (last sees key 31) the same.
  qi, kj, _, _ = tile_pairs(16, 32, Tiling(8, 16, causal_offset=16))
  assert list(zip(qi.tolist(), kj.tolist())) == [(0, 0), (0, 16), (8, 0), (8, 16)]
  # No static skipping, a partial tile (37 = 2 x 16 + 5), tiles clipped to the length.
  assert len(tile_pairs(37, 37, Tiling(16, 16, causal_offset=None))[0]) == 9
  assert tile_pairs(5, 7, Tiling(64, 64))[2:] == (5, 7)
  with pytest.raises(ValueError, match="block sizes must be positive"):
    Tiling(0, 8)


def test_skipped_pairs_are_absent_from_the_program():
  """The causal schedule's loop runs 10 pair steps for 4 x 4 tiles, not 16 (forward and backward)."""
  q, k, v, w = _qkvw(32, 32, jnp.float32)
  mask = jnp.ones((B, 32, 32), bool)
  f = lambda q, k, v: jnp.sum(tiled_attend(q, k, v, (mask,), 0.3, Tiling(8, 8)) * w)  # noqa: E731
  lengths = [e.params["length"] for e in jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v).eqns
             if e.primitive.name == "scan"]
  assert lengths == [10, 10]


def test_rejects_bad_shapes():
  q, k, v, _ = _qkvw(8, 8, jnp.float32)
  with pytest.raises(ValueError, match="mask shapes"):
    tiled_attend(q, k, v, (jnp.ones((B, 8, 9), bool),), 0.3)
  with pytest.raises(ValueError, match=r"must be \[B, L, H, Q\]"):
    tiled_attend(q, k[:, :, :2], v, (jnp.ones((B, 8, 8), bool),), 0.3)


def test_kernel_choice():
  cfg = ModelConfig()
  assert resolve_kernel(cfg, "cpu") == "tiled" and resolve_kernel(cfg, "gpu") == "whole"
  assert resolve_kernel(dataclasses.replace(cfg, attention_kernel="whole"), "cpu") == "whole"
  with pytest.raises(ValueError, match="attention_kernel='flash'; valid: \\['auto', 'whole', 'tiled', 'pallas'\\]"):
    resolve_kernel(dataclasses.replace(cfg, attention_kernel="flash"))
  # Both kernels give the same self-attention (the model's path).
  q, k, v, _ = _qkvw(L, L, jnp.float32)
  seg = _packed(L)
  mask = segment_causal_mask(seg, seg)
  outs = [self_attend(q, k, v, mask, dataclasses.replace(cfg, attention_kernel=kn, attention_block=16))
          for kn in ("whole", "tiled")]
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_attend_tiled_lowers_for_cuda():
  q, k, v, w = _qkvw(L, L, jnp.bfloat16)
  seg = _packed(L)
  mask = segment_causal_mask(seg, seg)
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend_tiled(q, k, v, mask, 0.3, block=16).astype(jnp.float32) * w),
                       argnums=(0, 1, 2)))
  f.trace(q, k, v).lower(lowering_platforms=("cuda",))
