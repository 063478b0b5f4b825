"""Grouped-matmul kernels vs their jnp references, forward and gradients (kernels_pallas/; interpret mode on CPU).

`GroupedMatmulTest` runs the compiled kernels and needs a GPU; `GroupedMatmulInterpretTest` runs the same checks in
the Pallas interpreter on CPU. Shapes stay tiny (T <= 96, K, N <= 64, E <= 4) because interpretation is slow.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import formats
from kernels_pallas.grouped_matmul import BlockSizes, grouped_matmul, grouped_matmul_reference
from kernels_pallas.moe_matmul import moe_matmul
from kernels_pallas.transposed_grouped_matmul import (
  transposed_grouped_matmul,
  transposed_grouped_matmul_reference,
)

BLOCKS = BlockSizes(block_m=16, block_n=16, block_k=32)
# Group patterns over T=40 rows with 16-row tiles: a zero-sized group, boundaries inside tiles, a partial last
# tile, all rows in one group, and rows past sum(group_sizes) (must give zeros).
GROUP_PATTERNS = {
  "mixed_with_empty": [10, 0, 17, 13],
  "one_group": [0, 0, 40, 0],
  "tile_aligned": [16, 16, 0, 8],
  "short_sum": [3, 5, 0, 20],
}


def tolerances(fmt: str, out_dtype) -> dict:
  """Kernel-vs-reference tolerance, relative to the output's max magnitude.

  Both sides multiply the same quantised values, so they differ only by f32 summation order (~1e-6 of the max for
  K <= 64) plus the output rounding (bf16: 2^-8). `fmt` does not change this; it is an argument so a future
  native-FP4 dot (different accumulation) can widen it in one place.
  """
  del fmt
  return dict(rtol=0.0, atol_rel=2.0 ** -8 if out_dtype == jnp.bfloat16 else 2e-6)


def assert_close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(float(np.abs(want).max()), 1e-30)
  np.testing.assert_allclose(got, want, rtol=tol["rtol"], atol=tol["atol_rel"] * scale)


# Quantisation error of each format vs exact f32 on Gaussian data (norm-relative): bf16 rounds to 8 bits
# (~2^-9 per element), E4M3 to 4 bits (~2^-5), E2M1 to 2 bits with E4M3 block scales (~10%, measured 9-13%).
FORMAT_ERROR = {"bf16": 1e-2, "mxfp8": 6e-2, "nvfp4": 0.2}


def _inputs(t=40, k=64, n=32, e=4, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (t, k)), jax.random.normal(kw, (e, k, n)) / 8


class GroupedMatmulTest:
  INTERPRET = False

  @pytest.mark.parametrize("fmt", formats.FORMATS)
  @pytest.mark.parametrize("pattern", GROUP_PATTERNS)
  def test_forward_matches_reference(self, fmt, pattern):
    x, w = _inputs()
    gs = jnp.array(GROUP_PATTERNS[pattern], jnp.int32)
    a, b = formats.quantize(x, fmt, axis=1), formats.quantize(w, fmt, axis=1, batch_dims=1)
    out_dtype = jnp.float32 if pattern != "one_group" else jnp.bfloat16
    got = grouped_matmul(a, b, gs, out_dtype=out_dtype, block_sizes=BLOCKS, interpret=self.INTERPRET)
    assert got.shape == (40, 32) and got.dtype == out_dtype
    assert_close(got, grouped_matmul_reference(a, b, gs), tolerances(fmt, out_dtype))
    total = int(gs.sum())
    np.testing.assert_array_equal(np.asarray(got[total:], np.float32), 0.0)

  @pytest.mark.parametrize("fmt,k", [("bf16", 96), ("mxfp8", 128), ("nvfp4", 128)])
  def test_forward_with_k_substeps(self, fmt, k):
    # block_k=64 over K=128: two unrolled 32-wide sub-steps per iteration (quantised formats); for bf16, K=96 makes
    # `fit` shrink block_k to 32 so that it divides K.
    x, w = _inputs(k=k)
    gs = jnp.array(GROUP_PATTERNS["mixed_with_empty"], jnp.int32)
    a, b = formats.quantize(x, fmt, axis=1), formats.quantize(w, fmt, axis=1, batch_dims=1)
    bs = BlockSizes(block_m=16, block_n=32, block_k=64)
    got = grouped_matmul(a, b, gs, out_dtype=jnp.float32, block_sizes=bs, interpret=self.INTERPRET)
    assert_close(got, grouped_matmul_reference(a, b, gs), tolerances(fmt, jnp.float32))

  @pytest.mark.parametrize("fmt", formats.FORMATS)
  @pytest.mark.parametrize("pattern", ["mixed_with_empty", "short_sum"])
  def test_transposed_forward_matches_reference(self, fmt, pattern):
    x, _ = _inputs(t=96, k=32)
    y = jax.random.normal(jax.random.key(3), (96, 64))
    gs = jnp.array(GROUP_PATTERNS[pattern], jnp.int32) * 2
    a, b = formats.quantize(x, fmt, axis=0), formats.quantize(y, fmt, axis=0)
    got = transposed_grouped_matmul(a, b, gs, block_sizes=BLOCKS, interpret=self.INTERPRET)
    assert got.shape == (4, 32, 64)
    assert_close(got, transposed_grouped_matmul_reference(a, b, gs), tolerances(fmt, jnp.float32))
    np.testing.assert_array_equal(np.asarray(got[np.asarray(gs) == 0]), 0.0)    # empty groups: zero gradient

  def test_references_equal_ragged_dot_and_a_per_expert_loop(self):
    # The one-hot einsum references are checked against XLA's ragged_dot and a plain per-expert loop (STYLE §12).
    x, w = _inputs()
    y = jax.random.normal(jax.random.key(3), (40, 32))
    sizes = GROUP_PATTERNS["short_sum"]
    gs = jnp.array(sizes, jnp.int32)
    loop_out, loop_t, start = np.zeros((40, 32), np.float32), np.zeros((4, 64, 32), np.float32), 0
    for e, size in enumerate(sizes):
      rows = slice(start, start + size)
      loop_out[rows] = np.asarray(x[rows]) @ np.asarray(w[e])
      loop_t[e] = np.asarray(x[rows]).T @ np.asarray(y[rows])
      start += size
    tol = tolerances("bf16", jnp.float32)
    assert_close(grouped_matmul_reference(x, w, gs), loop_out, tol)
    assert_close(grouped_matmul_reference(x, w, gs), jax.lax.ragged_dot(x, w, gs, precision="highest"), tol)
    assert_close(transposed_grouped_matmul_reference(x, y, gs), loop_t, tol)

  @pytest.mark.parametrize("fmt", formats.FORMATS)
  def test_gradients_match_reference_vjp(self, fmt):
    x, w = _inputs()
    gs = jnp.array(GROUP_PATTERNS["mixed_with_empty"], jnp.int32)
    ct = jax.random.normal(jax.random.key(2), (40, 32))

    def grads(**kw):
      return jax.grad(lambda x, w: jnp.sum(moe_matmul(x, w, gs, matmul=fmt, **kw) * ct), (0, 1))(x, w)

    got = grads(impl="pallas", interpret=self.INTERPRET, block_sizes=BLOCKS)
    want = grads(impl="reference")
    exact = jax.grad(lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, gs, precision="highest") * ct), (0, 1))(x, w)
    for g, r, e in zip(got, want, exact):
      assert_close(g, r, tolerances(fmt, jnp.float32))
      rel = float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
      assert rel < FORMAT_ERROR[fmt], (fmt, rel)
    np.testing.assert_array_equal(np.asarray(got[1][1]), 0.0)       # the empty expert gets no gradient

  def test_bf16_backward_option(self):
    x, w = _inputs()
    gs = jnp.array(GROUP_PATTERNS["tile_aligned"], jnp.int32)
    ct = jax.random.normal(jax.random.key(2), (40, 32))

    def grads(matmul, backward, impl):
      f = lambda x, w: jnp.sum(moe_matmul(x, w, gs, matmul=matmul, backward=backward, impl=impl,
                                          interpret=self.INTERPRET, block_sizes=BLOCKS) * ct)
      return jax.grad(f, (0, 1))(x, w)

    got = grads("nvfp4", "bf16", "pallas")
    want = grads("bf16", "quantized", "reference")     # the backward is then exactly the bf16 one
    for g, r in zip(got, want):
      assert_close(g, r, tolerances("bf16", jnp.float32))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Triton kernels need a GPU")
class TestGroupedMatmulGpu(GroupedMatmulTest):
  INTERPRET = False


class TestGroupedMatmulInterpret(GroupedMatmulTest):
  INTERPRET = True


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_gpu_lowering(fmt):
  """The Triton kernels lower for CUDA (validates block shapes, dtypes and ops without a GPU)."""
  x, w = _inputs(t=64)
  gs = jnp.array([20, 0, 30, 14], jnp.int32)
  a, b = formats.quantize(x, fmt, axis=1), formats.quantize(w, fmt, axis=1, batch_dims=1)
  f = lambda a, b, g: grouped_matmul(a, b, g, block_sizes=BLOCKS)
  assert "grouped_matmul" in jax.jit(f).trace(a, b, gs).lower(lowering_platforms=("cuda",)).as_text()
  y = jax.random.normal(jax.random.key(1), (64, 32))
  a, b = formats.quantize(x, fmt, axis=0), formats.quantize(y, fmt, axis=0)
  f = lambda a, b, g: transposed_grouped_matmul(a, b, g, block_sizes=BLOCKS)
  assert "grouped_matmul" in jax.jit(f).trace(a, b, gs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_gpu_lowering_of_training_step(fmt):
  """Forward + both gradients of `moe_matmul` (custom_vjp, quantised backward) lower for CUDA."""
  x, w = _inputs(t=64)
  gs = jnp.array([20, 0, 30, 14], jnp.int32)
  f = jax.grad(lambda x, w: jnp.sum(moe_matmul(x, w, gs, matmul=fmt, impl="pallas", interpret=False,
                                               block_sizes=BLOCKS)), (0, 1))
  text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("grouped_matmul") >= 3        # forward, dx (grouped) and dw (transposed) kernels


def test_bad_inputs_are_clear_errors():
  x, w = _inputs()
  gs = jnp.array([10, 0, 17, 13], jnp.int32)
  with pytest.raises(ValueError, match="same format"):
    grouped_matmul(formats.quantize_mxfp8(x), w, gs, interpret=True)
  with pytest.raises(ValueError, match="Contraction sizes differ"):
    grouped_matmul(x, w[:, :32], gs, interpret=True)
  with pytest.raises(ValueError, match="group_sizes must be an integer"):
    grouped_matmul(x, w, gs[:3], interpret=True)
  with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
    grouped_matmul(x, w, gs, block_sizes=BlockSizes(block_n=48), interpret=True)
  with pytest.raises(ValueError, match="blocked along K"):
    grouped_matmul(formats.quantize_mxfp8(x[:32], axis=0), formats.quantize_mxfp8(w, axis=1), gs, interpret=True)
  with pytest.raises(ValueError, match="Unknown moe matmul='fp8'"):
    moe_matmul(x, w, gs, matmul="fp8")
