"""Transposed grouped matmul (the weight gradient of a grouped matmul) as a Pallas Triton kernel, beside its reference.

`out[e] = lhs[rows of e].T @ rhs[rows of e]`: the contraction runs over the sorted tokens of each group. Quantised
operands are blocked along T (axis 0), so a 32-row (MXFP8) or 16-row (NVFP4) scale block may straddle two groups:
it is shared, and each group keeps only its own rows (masked after decoding). The grid is (E, K tiles, N tiles);
each program loops over the row steps of its group, so empty groups give zeros without work.

Letters: T tokens (sorted by expert), K rows of the output, N columns of the output, E experts (groups).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import formats
from kernels_pallas.grouped_matmul import _STEP_K, BlockSizes, _check_pow2, _format_of

_DN_T = (((0,), (0,)), ((), ()))      # contract the token axis of both operands


def _tdot(a, b):
  return jax.lax.dot_general(a, b, _DN_T, preferred_element_type=jnp.float32)


def _kernel(offsets_ref, *refs, fmt: str, step: int, block_k: int, block_n: int):
  *in_refs, out_ref = refs
  e, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = offsets_ref[e], offsets_ref[e + 1]
  ks, ns = pl.ds(kb * block_k, block_k), pl.ds(nb * block_n, block_n)
  zeros = jnp.zeros((block_k, block_n), jnp.float32)

  def keep(r0, stride=1, size=step):
    rows = r0 + stride * jnp.arange(size, dtype=jnp.int32)
    return ((rows >= start) & (rows < end))[:, None]

  if fmt == "bf16":
    lhs_ref, rhs_ref = in_refs

    def body(i, acc):
      a = lhs_ref[pl.ds(i * step, step), ks]
      b = rhs_ref[pl.ds(i * step, step), ns]
      return acc + _tdot(jnp.where(keep(i * step), a, jnp.zeros_like(a)), b)
    scale = None

  elif fmt == "mxfp8":
    lq_ref, ls_t_ref, rq_ref, rs_ref = in_refs

    def body(i, acc):
      a = lq_ref[pl.ds(i * step, step), ks]
      a = jnp.where(keep(i * step), a, jnp.zeros_like(a))
      b = rq_ref[pl.ds(i * step, step), ns]
      sa = ls_t_ref[ks, pl.ds(i, 1)]                   # [bk, 1] (lhs scales passed transposed)
      sb = rs_ref[pl.ds(i, 1), ns]                     # [1, bn]
      return acc + _tdot(a, b) * sa * sb
    scale = None

  else:
    lp_ref, lbs_ref, lg_t_ref, rp_ref, rbs_ref, rg_ref = in_refs
    nbk = step // formats.NVFP4_BLOCK                  # scale blocks per step
    pb = formats.NVFP4_BLOCK // 2                      # packed rows per scale block

    def expand(s_ref, i, cols, width):
      s = s_ref[pl.ds(i * nbk, nbk), cols].astype(jnp.float32)
      return jnp.broadcast_to(s[:, None, :], (nbk, pb, width)).reshape(nbk * pb, width)

    def body(i, acc):
      pa = lp_ref[pl.ds(i * nbk * pb, nbk * pb), ks]
      pbt = rp_ref[pl.ds(i * nbk * pb, nbk * pb), ns]
      sa, sb = expand(lbs_ref, i, ks, block_k), expand(rbs_ref, i, ns, block_n)
      dec = lambda c, s: (formats.decode_e2m1(c) * s).astype(jnp.bfloat16)
      total = acc
      for half, shift in ((0, 0), (1, 4)):             # low nibbles hold even rows, high nibbles odd rows
        a = jnp.where(keep(i * step + half, 2, nbk * pb), dec((pa >> shift) & 15, sa), 0.0).astype(jnp.bfloat16)
        total = total + _tdot(a, dec((pbt >> shift) & 15, sb))
      return total
    scale = lambda acc: acc * lg_t_ref[ks, pl.ds(0, 1)] * rg_ref[pl.ds(0, 1), ns]

  acc = jax.lax.fori_loop(start // step, pl.cdiv(end, step), body, zeros)
  if scale is not None:
    acc = scale(acc)
  out_ref[...] = acc.astype(out_ref.dtype)


def _operands(x, fmt: str, t_pad: int, transpose_scales: bool) -> list[jax.Array]:
  """Flattens an operand blocked along T into kernel inputs, padding T to `t_pad` (in each array's own units).

  With `transpose_scales` the last array (MXFP8 scales, NVFP4 second-level scale) is transposed so the kernel reads
  it as a [K, ...] column.
  """
  if fmt == "bf16":
    arrs = [(x, 1)]
  elif fmt == "mxfp8":
    arrs = [(x.q, 1), (x.scale.astype(jnp.float32), formats.MXFP8_BLOCK)]
  else:
    g = jnp.broadcast_to(x.global_scale, (1, x.packed.shape[1])).astype(jnp.float32)
    arrs = [(x.packed, 2), (x.block_scale, formats.NVFP4_BLOCK), (g, None)]
  out = [a if per is None else jnp.pad(a, ((0, t_pad // per - a.shape[0]), (0, 0))) for a, per in arrs]
  if transpose_scales and fmt != "bf16":
    out[-1] = out[-1].T
  return out


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def transposed_grouped_matmul(lhs, rhs, group_sizes: jax.Array, *, out_dtype=jnp.float32,
                              block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
  """Per-group `lhs_g.T @ rhs_g` with f32 accumulation (the weight gradient of `grouped_matmul`).

  Args:
    lhs: [T, K] sorted tokens: a bf16/f32 array, or an `MXFP8Array` / `NVFP4Array` quantised along axis 0 (T).
    rhs: [T, N] in the same format as `lhs`, quantised along axis 0.
    group_sizes: [E] int rows per group (sum <= T).
    out_dtype: output dtype.
    block_sizes: `block_k`/`block_n` tile the output and `block_m` is the bf16 step over T.
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    [E, K, N] in `out_dtype`; groups with no rows give zeros.
  """
  fmt = _format_of(lhs)
  if _format_of(rhs) != fmt:
    raise ValueError(f"lhs is {fmt} but rhs is {_format_of(rhs)}; both operands must use the same format.")
  if len(lhs.shape) != 2 or len(rhs.shape) != 2 or lhs.shape[0] != rhs.shape[0]:
    raise ValueError(f"Expected lhs [T, K] and rhs [T, N] with the same T, got {lhs.shape=} and {rhs.shape=}.")
  if fmt != "bf16" and (lhs.axis % 2, rhs.axis % 2) != (0, 0):
    raise ValueError(f"Quantised operands must be blocked along T (axis 0), got {lhs.axis=} {rhs.axis=}.")
  (t, k), n = lhs.shape, rhs.shape[1]
  e = group_sizes.shape[0]
  if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be a 1-D integer array, got {group_sizes.shape} {group_sizes.dtype}.")
  bs = (block_sizes or BlockSizes.default()).fit(t, k, n)
  bk = bs.block_k
  for name, v in (("block_m", bs.block_m), ("block_k", bk), ("block_n", bs.block_n)):
    _check_pow2(name, v)
  if k % bk or n % bs.block_n:
    raise ValueError(f"block_k={bk} must divide {k=} and block_n={bs.block_n} must divide {n=}.")
  step = _STEP_K.get(fmt, bs.block_m)
  if fmt == "bf16":
    dt = jnp.promote_types(lhs.dtype, rhs.dtype)
    lhs, rhs = lhs.astype(dt), rhs.astype(dt)
  elif t % (formats.MXFP8_BLOCK if fmt == "mxfp8" else formats.NVFP4_BLOCK):
    raise ValueError(f"{fmt} operands have T={t}, not a whole number of scale blocks.")
  t_pad = pl.cdiv(t, step) * step
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])
  inputs = _operands(lhs, fmt, t_pad, True) + _operands(rhs, fmt, t_pad, False)
  kernel = functools.partial(_kernel, fmt=fmt, step=step, block_k=bk, block_n=bs.block_n)
  return pl.pallas_call(
      kernel,
      grid=(e, k // bk, n // bs.block_n),
      in_specs=[pl.no_block_spec] * (1 + len(inputs)),
      out_specs=pl.BlockSpec((None, bk, bs.block_n), lambda g, i, j: (g, i, j)),
      out_shape=jax.ShapeDtypeStruct((e, k, n), out_dtype),
      compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name=f"transposed_grouped_matmul_{fmt}",
  )(offsets, *inputs)


def transposed_grouped_matmul_reference(lhs, rhs, group_sizes: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
  """Plain-jnp reference: dequantise to f32 and contract each group's rows with a one-hot mask."""
  x_TxK = formats.dequantize(lhs)
  y_TxN = formats.dequantize(rhs)
  ends = jnp.cumsum(group_sizes)
  t_ids = jnp.arange(x_TxK.shape[0])
  onehot_TxE = (t_ids[:, None] >= (ends - group_sizes)[None, :]) & (t_ids[:, None] < ends[None, :])
  out = jnp.einsum("te,tk,tn->ekn", onehot_TxE.astype(jnp.float32), x_TxK, y_TxN, precision=jax.lax.Precision.HIGHEST)
  return out.astype(out_dtype)
