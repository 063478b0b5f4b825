"""flash_gpu.attend_pallas (jax's Pallas flash kernel, segment ids derived from the mask) against attend_reference.

Pallas' interpreter runs the kernel on CPU (values and gradients, float32: rounding-level gaps, 1e-5 allowed); the
cuda lowering is checked without a GPU. Not checked here: compiling or timing it on a GPU.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.model import ModelConfig
from composer_jax.model.attention import attend_reference, segment_causal_mask, self_attend
from composer_jax.model.flash_gpu import attend_pallas, segment_ids_from_mask

B, L, H, Q, DV = 2, 40, 2, 12, 8     # L = 40 in blocks of 16: a partial last block; Q != Dv as in MLA


def _inputs():
  ks = jax.random.split(jax.random.key(0), 4)
  shapes = [(B, L, H, Q), (B, L, H, Q), (B, L, H, DV), (B, L, H, DV)]
  return tuple(jax.random.normal(ks[i], s) for i, s in enumerate(shapes))


def _packed_mask():
  seg = jnp.array([[1] * 10 + [2] * 20 + [0] * 10, [1] * L], jnp.int32)
  return segment_causal_mask(seg, seg)


def _left_padded_mask():
  """The engine's fresh prefill: pad <= s <= l (row 0 has 5 pad slots that see nothing)."""
  pad, s = jnp.array([5, 0]), jnp.arange(L)
  return (s[None, None, :] <= s[None, :, None]) & (s[None, None, :] >= pad[:, None, None])


def test_segment_ids_from_mask_by_hand():
  seg = jnp.array([[1, 1, 2, 0, 2, 0]], jnp.int32)   # a segment interrupted by padding keeps one id
  ids, seen = segment_ids_from_mask(segment_causal_mask(seg, seg))
  np.testing.assert_array_equal(ids, [[0, 0, 2, 3, 2, 3]])
  assert bool(seen.all())
  ids, seen = segment_ids_from_mask(_left_padded_mask()[:, :7, :7])
  np.testing.assert_array_equal(ids[0], [-1, -2, -3, -4, -5, 5, 5])
  np.testing.assert_array_equal(seen[0], [False] * 5 + [True] * 2)


@pytest.mark.parametrize("mask_fn", [_packed_mask, _left_padded_mask], ids=["packed", "left-padded"])
def test_pallas_interpreted_equals_reference(mask_fn):
  q, k, v, w = _inputs()
  mask = mask_fn()

  def loss(f):
    return lambda q, k, v: jnp.sum(f(q, k, v) * w)
  pallas = lambda q, k, v: attend_pallas(q, k, v, mask, 0.3, block=16, interpret=True)  # noqa: E731
  ref = lambda q, k, v: attend_reference(q, k, v, mask, 0.3)  # noqa: E731
  np.testing.assert_allclose(pallas(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-5)
  for g, r in zip(jax.grad(loss(pallas), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_pallas_kernel_lowers_for_cuda():
  q, k, v, w = (a.astype(jnp.bfloat16) for a in _inputs())
  cfg = dataclasses.replace(ModelConfig(qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=DV),
                            attention_kernel="pallas")
  mask = _packed_mask()
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(self_attend(q, k, v, mask, cfg).astype(jnp.float32) * w),
                       argnums=(0, 1, 2)))
  assert "triton" in f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text().lower()


def test_rejects_values_wider_than_keys():
  q, k, v, _ = _inputs()
  with pytest.raises(ValueError, match="needs Dv <= Q"):
    attend_pallas(q[..., :4], k[..., :4], v, _packed_mask(), 0.3, interpret=True)
