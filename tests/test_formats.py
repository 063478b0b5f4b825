"""MXFP8 / NVFP4 quantisation references: hand-worked blocks, ml_dtypes, edge cases (kernels_pallas/formats.py)."""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import formats as f

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


def np_mxfp8(x: np.ndarray) -> np.ndarray:
  """Independent numpy MXFP8 fake-quantisation of [R, K] along K (per OCP MX v1.0 with saturation)."""
  out = np.zeros_like(x, dtype=np.float32)
  for r in range(x.shape[0]):
    for b in range(0, x.shape[1], 32):
      blk = x[r, b:b + 32].astype(np.float64)
      amax = np.abs(blk).max()
      exp = -127 if amax == 0 else max(-127, math.floor(math.log2(amax)) - 8)
      q = np.clip(blk / 2.0 ** exp, -448, 448).astype(E4M3).astype(np.float64)
      out[r, b:b + 32] = q * 2.0 ** exp
  return out


def np_nvfp4(x: np.ndarray, per_token: bool) -> np.ndarray:
  """Independent numpy NVFP4 fake-quantisation of [R, K] along K."""
  out = np.zeros_like(x, dtype=np.float32)
  tensor_amax = np.abs(x).max()
  for r in range(x.shape[0]):
    amax = np.abs(x[r]).max() if per_token else tensor_amax
    g = np.float32(amax / np.float32(2688.0)) if amax > 0 else np.float32(1.0)
    for b in range(0, x.shape[1], 16):
      blk = x[r, b:b + 16].astype(np.float32)
      s = np.float32(np.float32(np.abs(blk).max() / np.float32(6.0)) / g).astype(E4M3).astype(np.float32)
      eff = np.float32(s * g)
      q = np.zeros_like(blk) if eff == 0 else np.clip(blk / eff, -6, 6).astype(E2M1).astype(np.float32)
      out[r, b:b + 16] = q * s * g
  return out


def test_mxfp8_hand_worked_block():
  # amax 3 -> floor(log2 3) = 1 -> shared exponent 1 - 8 = -7; elements are x * 2^7.
  x = np.zeros((1, 32), np.float32)
  x[0, :4] = [3.0, 1.0, -0.5, 0.3]
  a = f.quantize_mxfp8(jnp.asarray(x))
  assert a.q.dtype == jnp.float8_e4m3fn and a.scale.dtype == jnp.float8_e8m0fnu
  assert float(a.scale[0, 0]) == 2.0 ** -7
  np.testing.assert_array_equal(np.asarray(a.q[0, :4], np.float32), [384.0, 128.0, -64.0, 40.0])  # 38.4 -> 40
  np.testing.assert_array_equal(np.asarray(f.dequantize(a))[0, :4], [3.0, 1.0, -0.5, 0.3125])


def test_mxfp8_saturates_instead_of_nan():
  # amax 1.9375 -> exponent -8 -> 496 exceeds E4M3's 448: clamps to 448 (a plain cast would give NaN).
  x = jnp.zeros((1, 32)).at[0, 0].set(1.9375).at[0, 1].set(-1.9375)
  d = np.asarray(f.dequantize(f.quantize_mxfp8(x)))
  np.testing.assert_array_equal(d[0, :2], [1.75, -1.75])


def test_mxfp8_zero_block_and_subnormals():
  x = np.zeros((1, 64), np.float32)
  x[0, 32] = 1.0                    # exponent -8: elements scale by 256
  x[0, 33] = 2.0 ** -16             # -> 2^-8, an E4M3 subnormal, kept exactly
  x[0, 34] = 2.0 ** -18             # -> 2^-10, half the smallest subnormal: rounds to even (0)
  x[0, 35] = 3 * 2.0 ** -18         # -> 1.5 * 2^-9: rounds to 2^-8 (nearest even)
  a = f.quantize_mxfp8(jnp.asarray(x))
  assert np.asarray(a.scale, np.float32)[0, 0] == 2.0 ** -127          # zero block: the smallest E8M0 scale
  np.testing.assert_array_equal(np.asarray(a.q, np.float32)[0, :32], 0)
  d = np.asarray(f.dequantize(a))
  np.testing.assert_array_equal(d[0, :32], 0)
  np.testing.assert_array_equal(d[0, 32:36], [1.0, 2.0 ** -16, 0.0, 2.0 ** -16])


def test_mxfp8_nonfinite_poisons_only_its_block():
  x = jnp.ones((2, 64)).at[0, 3].set(jnp.nan).at[1, 40].set(jnp.inf)
  a = f.quantize_mxfp8(x)
  assert np.isnan(np.asarray(a.scale, np.float32)[0, 0]) and np.isnan(np.asarray(a.scale, np.float32)[1, 1])
  d = np.asarray(f.dequantize(a))
  assert np.isnan(d[0, :32]).all() and np.isnan(d[1, 32:]).all()
  np.testing.assert_array_equal(d[0, 32:], 1.0)
  np.testing.assert_array_equal(d[1, :32], 1.0)


def test_mxfp8_matches_numpy_ml_dtypes_reference():
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((8, 128)) * np.exp(rng.uniform(-12, 12, (8, 1)))).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(f.dequantize(f.quantize_mxfp8(jnp.asarray(x)))), np_mxfp8(x))


def test_mxfp8_along_axis_1_of_weights():
  w = jax.random.normal(jax.random.key(0), (3, 64, 8))
  a = f.quantize_mxfp8(w, axis=1)
  assert a.q.shape == (3, 64, 8) and a.scale.shape == (3, 2, 8)
  w_t = np.asarray(jnp.swapaxes(w, 1, 2)).reshape(24, 64)
  expect = np.swapaxes(np_mxfp8(w_t).reshape(3, 8, 64), 1, 2)
  np.testing.assert_array_equal(np.asarray(f.dequantize(a)), expect)


def test_e2m1_codes_match_ml_dtypes_and_pack_round_trips():
  codes = np.arange(16, dtype=np.uint8)
  expect = codes.view(np.uint8).astype(np.uint8)
  values = np.array([E2M1(v) for v in [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]])
  np.testing.assert_array_equal(np.asarray(f.decode_e2m1(jnp.asarray(codes))), values.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(f.encode_e2m1(jnp.asarray(values.astype(np.float32)))), expect)
  assert int(f.pack_fp4(jnp.array([[1, 2]], jnp.uint8))[0, 0]) == 0x21          # element 0 in the low nibble
  all_bytes = jnp.arange(256, dtype=jnp.uint8).reshape(4, 64)
  np.testing.assert_array_equal(f.pack_fp4(f.unpack_fp4(all_bytes)), all_bytes)
  np.testing.assert_array_equal(f.pack_fp4(f.unpack_fp4(all_bytes.T, 0), 0), all_bytes.T)


def test_nvfp4_hand_worked_block():
  # Row amax 6 -> second-level scale 6/2688; block amax 6 -> block scale 448, effective scale exactly 1.
  x = np.zeros((1, 16), np.float32)
  x[0, :7] = [6.0, 5.0, 2.5, 0.25, -0.75, 1.75, -5.5]
  a = f.quantize_nvfp4(jnp.asarray(x))
  assert a.packed.shape == (1, 8) and a.packed.dtype == jnp.uint8 and a.block_scale.shape == (1, 1)
  assert float(a.block_scale[0, 0].astype(jnp.float32)) == 448.0
  np.testing.assert_allclose(float(a.global_scale[0, 0]), 6.0 / 2688.0, rtol=1e-7)
  d = np.asarray(f.dequantize(a))
  # 5 and 2.5 tie to the even code (4, 2); 0.25 ties to 0; -0.75 ties to -1; 1.75 ties to 2; -5.5 rounds to -6.
  np.testing.assert_allclose(d[0, :7], [6.0, 4.0, 2.0, 0.0, -1.0, 2.0, -6.0], rtol=1e-6)


@pytest.mark.parametrize("second_level", f.SECOND_LEVEL_MODES)
def test_nvfp4_matches_numpy_ml_dtypes_reference(second_level):
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((6, 64)) * np.exp(rng.uniform(-4, 4, (6, 1)))).astype(np.float32)
  got = np.asarray(f.dequantize(f.quantize_nvfp4(jnp.asarray(x), second_level=second_level)))
  np.testing.assert_allclose(got, np_nvfp4(x, second_level == "per_token"), rtol=1e-6, atol=0)


def test_nvfp4_scale_shapes_and_per_expert_tensors():
  w = jax.random.normal(jax.random.key(0), (3, 32, 8)) * jnp.array([1.0, 10.0, 100.0])[:, None, None]
  tok = f.quantize_nvfp4(w, axis=1, second_level="per_token", batch_dims=1)
  ten = f.quantize_nvfp4(w, axis=1, second_level="per_tensor", batch_dims=1)
  assert tok.packed.shape == (3, 16, 8) and tok.block_scale.shape == (3, 2, 8) and tok.global_scale.shape == (3, 1, 8)
  assert ten.global_scale.shape == (3, 1, 1)
  np.testing.assert_allclose(np.asarray(ten.global_scale[:, 0, 0]), np.abs(np.asarray(w)).max((1, 2)) / 2688.0,
                             rtol=1e-6)


def test_nvfp4_zero_row_and_nonfinite():
  x = jnp.ones((3, 32)).at[1].set(0.0).at[2, 5].set(jnp.nan)
  d = np.asarray(f.dequantize(f.quantize_nvfp4(x, second_level="per_token")))
  np.testing.assert_array_equal(d[0], 1.0)
  np.testing.assert_array_equal(d[1], 0.0)
  assert np.isnan(d[2]).all()                     # the NaN's second-level scale is NaN: its whole row
  d = np.asarray(f.dequantize(f.quantize_nvfp4(x.at[2, 5].set(-jnp.inf), second_level="per_tensor")))
  assert np.isnan(d).all()                        # per tensor: the whole tensor


def test_per_token_vs_per_tensor_with_an_outlier_token():
  x0 = jax.random.normal(jax.random.key(0), (16, 64))

  def err(mult, mode):
    x = x0.at[3].multiply(mult)
    d = f.dequantize(f.quantize_nvfp4(x, second_level=mode))
    return float(jnp.linalg.norm((d - x).at[3].set(0)) / jnp.linalg.norm(x.at[3].set(0)))

  base = err(1.0, "per_token")
  assert 0.05 < base < 0.15                       # E2M1 with E4M3 block scales on Gaussian data: ~9%
  for mult in (1e3, 1e6):
    assert err(mult, "per_token") == pytest.approx(base, rel=1e-6)   # other rows' scales do not see the outlier
  # Per tensor, the E4M3 block scales absorb a 1000x outlier (448 / 2^-9 spans ~2^17) ...
  assert err(1e3, "per_tensor") < 1.1 * base
  # ... but at 1e6 the other rows' block scales underflow to zero and those rows are lost.
  assert err(1e6, "per_tensor") > 0.9


@pytest.mark.parametrize("fn", [f.quantize_mxfp8, f.quantize_nvfp4])
def test_bad_block_size_is_a_clear_error(fn):
  with pytest.raises(ValueError, match="must be a multiple of the format's block"):
    fn(jnp.ones((2, 40)))


def test_bad_names_are_clear_errors():
  with pytest.raises(ValueError, match="second_level"):
    f.quantize_nvfp4(jnp.ones((2, 32)), second_level="per_row")
  with pytest.raises(ValueError, match="valid: \\('bf16', 'mxfp8', 'nvfp4'\\)"):
    f.quantize(jnp.ones((2, 32)), "fp8")
