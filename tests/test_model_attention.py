"""attention.attend (its own VJP) against attend_reference (the plain formula): values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.model.attention import attend, attend_reference, segment_causal_mask

B, L, H, Q, V = 2, 12, 3, 8, 5


def _inputs(dtype):
  k = jax.random.split(jax.random.key(0), 4)
  q, kk, v, w = (jax.random.normal(k[i], s) for i, s in enumerate([(B, L, H, Q), (B, L, H, Q), (B, L, H, V),
                                                                 (B, L, H, V)]))
  # Row 0: three packed segments and padding (segment 0); row 1: one segment.
  seg = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0, 0], [1] * L], jnp.int32)
  mask = segment_causal_mask(seg, seg)
  mask = mask.at[1, 4].set(False)   # a fully masked query row: zeros out, zero gradients, never NaN
  return q.astype(dtype), kk.astype(dtype), v.astype(dtype), mask, w


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_attend_equals_reference_values_and_grads(dtype, tol):
  q, k, v, mask, w = _inputs(dtype)
  scale = Q ** -0.5

  def loss(f):
    return lambda q, k, v: jnp.sum(f(q, k, v, mask, scale).astype(jnp.float32) * w)
  out, ref = jax.jit(attend, static_argnums=4)(q, k, v, mask, scale), attend_reference(q, k, v, mask, scale)
  assert out.dtype == ref.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
  np.testing.assert_array_equal(np.asarray(out[1, 4], np.float32), 0.0)
  got = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(attend_reference), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(got, want, strict=True):
    assert g.dtype == dtype and np.isfinite(np.asarray(g, np.float32)).all()
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=tol, atol=tol)
  np.testing.assert_array_equal(np.asarray(got[0][1, 4], np.float32), 0.0)   # the masked query gets no gradient


def test_attend_lowers_for_cuda():
  q, k, v, mask, w = _inputs(jnp.bfloat16)
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, mask, 0.3).astype(jnp.float32) * w),
                       argnums=(0, 1, 2)))
  f.trace(q, k, v).lower(lowering_platforms=("cuda",))
