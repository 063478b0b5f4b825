"""Block-scaled low-precision formats: MXFP8 (OCP Microscaling) and NVFP4, as plain-jnp references.

Both formats split the contraction axis into small blocks that share a scale:

* **MXFP8** (OCP MX spec v1.0): FP8 E4M3 elements, blocks of 32, one power-of-two E8M0 scale per block. The shared
  exponent is `floor(log2(amax)) - 8` (8 is E4M3's largest exponent), so the block maximum lands in [256, 512) and
  values above 448 saturate to +-448 (the spec leaves overflow to the implementation; saturation is the usual choice).
* **NVFP4**: FP4 E2M1 elements (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), blocks of 16, an FP8 E4M3 block scale, and a second
  FP32 scale shared either by the whole tensor (`per_tensor`) or by one row of the operand (`per_token`: one scale per
  token for activations, per output column for weights). The second scale is `amax / (448 * 6)`, which maps the
  largest block onto the top of the E4M3 scale range.

Quantised tensors keep the original axis order; only the contraction axis shrinks (`K -> K/32` for scales,
`K -> K/2` for packed FP4 bytes, `K -> 1` for the second-level scale).

Documented edge cases (each has a test in tests/test_formats.py):
* Zero block: MXFP8 scale is the smallest E8M0 value 2^-127, elements are 0; NVFP4 block scale is 0, elements 0.
  Both dequantise to exact zeros.
* Subnormals: element casts follow ml_dtypes (round to nearest even, E4M3 subnormals down to 2^-9 kept).
* Saturation: elements beyond the format maximum clamp to +-448 (E4M3) / +-6 (E2M1); never NaN.
* NaN/Inf input: the scale shared with it becomes NaN (E8M0 0xFF for MXFP8, the FP32 second-level scale for NVFP4),
  so every value sharing that scale dequantises to NaN. A non-finite input fails loudly instead of being clipped.

Letters: T tokens (rows), K contraction, N columns, E experts, G scale blocks along K.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E4M3_EMAX = 8
E2M1_MAX = 6.0
SECOND_LEVEL_MODES = ("per_token", "per_tensor")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP8Array:
  """E4M3 elements with one E8M0 scale per 32 values along `axis`."""
  q: jax.Array                  # float8_e4m3fn, the original shape
  scale: jax.Array              # float8_e8m0fnu, the original shape with K -> K/32
  axis: int = dataclasses.field(metadata=dict(static=True), default=-1)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.q.shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Array:
  """E2M1 elements packed two per byte along `axis`, E4M3 scale per 16 values, FP32 second-level scale."""
  packed: jax.Array             # uint8, the original shape with K -> K/2 (element 2i in the low nibble)
  block_scale: jax.Array        # float8_e4m3fn, the original shape with K -> K/16
  global_scale: jax.Array       # float32, the original shape with K -> 1 (per_token) or broadcastable (per_tensor)
  axis: int = dataclasses.field(metadata=dict(static=True), default=-1)

  @property
  def shape(self) -> tuple[int, ...]:
    s = list(self.packed.shape)
    s[self.axis] *= 2
    return tuple(s)


def _to_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
  """Moves `axis` last and splits it into [K/block, block]; raises if block does not divide it."""
  x = jnp.moveaxis(x, axis, -1)
  k = x.shape[-1]
  if k % block:
    raise ValueError(f"Contraction size {k=} (axis {axis}) must be a multiple of the format's block={block}.")
  return x.reshape(*x.shape[:-1], k // block, block)


def _from_blocks(x: jax.Array, axis: int) -> jax.Array:
  x = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
  return jnp.moveaxis(x, -1, axis)


@functools.partial(jax.jit, static_argnames=("axis",))
def quantize_mxfp8(x: jax.Array, axis: int = -1) -> MXFP8Array:
  """Quantises `x` to MXFP8 with blocks of 32 along `axis` (the contraction axis)."""
  xb = _to_blocks(x.astype(jnp.float32), axis, MXFP8_BLOCK)
  amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
  # frexp is exact (log2 is not, at powers of two): amax = m * 2^e with m in [0.5, 1), so floor(log2 amax) = e - 1.
  _, e = jnp.frexp(amax)
  exp = jnp.where(amax > 0, e - 1 - E4M3_EMAX, -127)
  exp = jnp.clip(exp, -127, 127)
  finite = jnp.isfinite(amax)
  exp = jnp.where(finite, exp, 0)
  # Multiply by 2^-exp (always a normal f32) rather than divide by a possibly subnormal 2^exp.
  q = jnp.clip(jnp.ldexp(xb, -exp), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  bits = jnp.where(finite, exp + 127, 255).astype(jnp.uint8)
  scale = jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)
  return MXFP8Array(q=_from_blocks(q, axis), scale=jnp.moveaxis(scale[..., 0], -1, axis), axis=axis)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp8(a: MXFP8Array, dtype=jnp.float32) -> jax.Array:
  """Returns elements times their block scale."""
  qb = _to_blocks(a.q.astype(jnp.float32), a.axis, MXFP8_BLOCK)
  s = jnp.moveaxis(a.scale.astype(jnp.float32), a.axis, -1)[..., None]
  return _from_blocks(qb * s, a.axis).astype(dtype)


def encode_e2m1(x: jax.Array) -> jax.Array:
  """FP4 E2M1 values (already representable) -> their 4-bit codes in uint8."""
  return jax.lax.bitcast_convert_type(x.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)


def decode_e2m1(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
  """4-bit E2M1 codes (uint8, high bits ignored) -> values, with arithmetic only so it also runs inside kernels."""
  mag = codes & 7
  e = mag >> 1
  m = (mag & 1).astype(dtype)
  pow2 = jnp.where(e == 3, 4.0, jnp.where(e == 2, 2.0, 1.0)).astype(dtype)
  val = jnp.where(e == 0, m * 0.5, pow2 * (1.0 + m * 0.5)).astype(dtype)
  return jnp.where((codes & 8) != 0, -val, val)


def pack_fp4(codes: jax.Array, axis: int = -1) -> jax.Array:
  """Packs 4-bit codes two per byte along `axis`: element 2i in the low nibble, 2i+1 in the high nibble."""
  c = jnp.moveaxis(codes.astype(jnp.uint8), axis, -1)
  if c.shape[-1] % 2:
    raise ValueError(f"FP4 packing needs an even size along axis {axis}, got {c.shape[-1]}.")
  packed = (c[..., 0::2] & 15) | ((c[..., 1::2] & 15) << 4)
  return jnp.moveaxis(packed, -1, axis)


def unpack_fp4(packed: jax.Array, axis: int = -1) -> jax.Array:
  """Inverse of `pack_fp4`: uint8 bytes -> 4-bit codes (uint8), twice as long along `axis`."""
  p = jnp.moveaxis(packed, axis, -1)
  codes = jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
  return jnp.moveaxis(codes, -1, axis)


@functools.partial(jax.jit, static_argnames=("axis", "second_level", "batch_dims"))
def quantize_nvfp4(x: jax.Array, axis: int = -1, second_level: str = "per_token", batch_dims: int = 0) -> NVFP4Array:
  """Quantises `x` to NVFP4 with blocks of 16 along `axis`.

  Args:
    x: array to quantise; `axis` is its contraction axis.
    axis: contraction axis (blocks and per-token scales run along it).
    second_level: "per_token" (one FP32 scale per row, i.e. per index of the other axes) or "per_tensor".
    batch_dims: leading axes that index separate tensors (e.g. 1 for per-expert weights [E, K, N]); "per_tensor"
      keeps one scale per index of these axes.

  Returns:
    An `NVFP4Array` in `x`'s axis order.
  """
  if second_level not in SECOND_LEVEL_MODES:
    raise ValueError(f"Unknown second_level={second_level!r}; valid: {SECOND_LEVEL_MODES}")
  axis = axis % x.ndim
  if axis < batch_dims:
    raise ValueError(f"The contraction {axis=} cannot be one of the {batch_dims=} leading tensor axes.")
  x = x.astype(jnp.float32)
  if second_level == "per_token":
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  else:
    amax = jnp.max(jnp.abs(x), axis=tuple(range(batch_dims, x.ndim)), keepdims=True)
  finite = jnp.isfinite(amax)
  gscale = jnp.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), 1.0)
  gscale = jnp.where(finite, gscale, jnp.nan)
  xb = _to_blocks(jnp.where(jnp.isfinite(x), x, 0.0), axis, NVFP4_BLOCK)
  g = jnp.moveaxis(jnp.broadcast_to(jnp.where(finite, gscale, 1.0), x.shape[:axis] + (1,) + x.shape[axis + 1:]),
                   axis, -1)[..., None]                    # [..., 1, 1]
  bamax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
  bscale = jnp.clip(bamax / E2M1_MAX / g, 0, E4M3_MAX).astype(jnp.float8_e4m3fn)
  eff = bscale.astype(jnp.float32) * g
  vals = jnp.where(eff > 0, xb / jnp.where(eff > 0, eff, 1.0), 0.0)
  codes = encode_e2m1(jnp.clip(vals, -E2M1_MAX, E2M1_MAX))
  packed = pack_fp4(_from_blocks(codes, axis), axis)
  return NVFP4Array(packed=packed, block_scale=jnp.moveaxis(bscale[..., 0], -1, axis), global_scale=gscale, axis=axis)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_nvfp4(a: NVFP4Array, dtype=jnp.float32) -> jax.Array:
  """Returns elements times block scale times second-level scale."""
  vals = decode_e2m1(unpack_fp4(a.packed, a.axis))
  vb = _to_blocks(vals, a.axis, NVFP4_BLOCK)
  s = jnp.moveaxis(a.block_scale.astype(jnp.float32), a.axis, -1)[..., None]
  return (_from_blocks(vb * s, a.axis) * a.global_scale).astype(dtype)


FORMATS = ("bf16", "mxfp8", "nvfp4")


def quantize(x: jax.Array, fmt: str, axis: int = -1, second_level: str = "per_token", batch_dims: int = 0):
  """Quantises to `fmt` ("bf16" casts); the one place format names are dispatched."""
  if fmt == "bf16":
    return x.astype(jnp.bfloat16)
  if fmt == "mxfp8":
    return quantize_mxfp8(x, axis)
  if fmt == "nvfp4":
    return quantize_nvfp4(x, axis, second_level, batch_dims)
  raise ValueError(f"Unknown format {fmt!r}; valid: {FORMATS}")


def dequantize(a, dtype=jnp.float32) -> jax.Array:
  """Dequantises any of the FORMATS (a plain array is cast)."""
  if isinstance(a, MXFP8Array):
    return dequantize_mxfp8(a, dtype)
  if isinstance(a, NVFP4Array):
    return dequantize_nvfp4(a, dtype)
  return a.astype(dtype)
