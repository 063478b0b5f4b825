"""Grouped (MoE) matmul as a Pallas Triton kernel, for bf16, MXFP8 and NVFP4 operands, beside its jnp reference.

`out[t] = lhs[t] @ rhs[group(t)]`, where the rows of `lhs` are sorted by group and `group_sizes[e]` rows belong to
expert e (rows past `sum(group_sizes)` give zeros, as in megablox).

Tiling: the grid is (row tiles of the sorted tokens, column tiles). Each program owns one output tile and loops over
the groups that intersect its rows (precomputed per tile from `group_sizes`), running the K loop once per group and
keeping only that group's rows. A tile straddling a group boundary is thus computed once per group (like megablox's
"visit the tile once per group"), but one program writes each output tile, so there are no races on GPU.

Per-format inner step (f32 accumulation throughout):
* bf16: `dot(a, b)` over `block_k` columns.
* MXFP8: one 32-wide scale block per step: `dot_fp8(qa, qb) * sa[:, None] * sb[None, :]` (the fine-grained scaling
  form of DeepGEMM-style FP8 GEMMs on Hopper).
* NVFP4: 32 elements (16 packed bytes, 2 scale blocks; Triton dots need K >= 16) per step. Both operands are
  packed along K with the same pairing, so `sum_k a_k b_k = dot(a_even, b_even) + dot(a_odd, b_odd)` and the
  nibbles never need interleaving; they are decoded arithmetically, multiplied by their E4M3 block scales (exact
  in bf16) and fed to bf16 dots.
  The FP32 second-level scales multiply the tile after the K loop.

Letters: T tokens (sorted by expert), K contraction, N output columns, E experts (groups), M row tiles.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import formats

_STEP_K = {"mxfp8": formats.MXFP8_BLOCK, "nvfp4": 2 * formats.NVFP4_BLOCK}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two, >= 16 for Triton dots) and Triton launch parameters.

  `block_k` is the K extent of one loop iteration; MXFP8 and NVFP4 split it into unrolled 32-element sub-steps (one
  MXFP8 block, two NVFP4 blocks), so for them it must be a multiple of 32.
  """
  block_m: int = 64
  block_n: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2

  @classmethod
  def default(cls) -> BlockSizes:
    return cls()

  def fit(self, t: int, k: int, n: int, min_k: int = 16) -> BlockSizes:
    """Shrinks blocks to the problem (powers of two >= 16; block_k >= min_k and dividing k when it can)."""
    def shrink(b, d):
      while b > 16 and b // 2 >= d:
        b //= 2
      return b
    bk = max(shrink(self.block_k, k), min_k)
    while k % bk and bk > min_k:
      bk //= 2
    return dataclasses.replace(self, block_m=shrink(self.block_m, t), block_n=shrink(self.block_n, n), block_k=bk)


def _format_of(x) -> str:
  if isinstance(x, formats.MXFP8Array):
    return "mxfp8"
  if isinstance(x, formats.NVFP4Array):
    return "nvfp4"
  return "bf16"


def _check_pow2(name: str, v: int):
  if v < 16 or v & (v - 1):
    raise ValueError(f"{name}={v} must be a power of two >= 16 (Triton tiles).")


def _validate(lhs, rhs, group_sizes, bs: BlockSizes) -> tuple[str, int, int, int, int]:
  fmt = _format_of(lhs)
  if _format_of(rhs) != fmt:
    raise ValueError(f"lhs is {fmt} but rhs is {_format_of(rhs)}; both operands must use the same format.")
  if len(lhs.shape) != 2 or len(rhs.shape) != 3:
    raise ValueError(f"Expected lhs [T, K] and rhs [E, K, N], got {lhs.shape=} and {rhs.shape=}.")
  (t, k), (e, k2, n) = lhs.shape, rhs.shape
  if k != k2:
    raise ValueError(f"Contraction sizes differ: lhs has K={k}, rhs has K={k2}.")
  if group_sizes.shape != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer [E={e}] array, got {group_sizes.shape} {group_sizes.dtype}.")
  if fmt != "bf16" and (lhs.axis % 2, rhs.axis % 3) != (1, 1):
    raise ValueError(f"Quantised operands must be blocked along K: lhs axis 1 and rhs axis 1, got "
                     f"{lhs.axis=} {rhs.axis=}.")
  for name in ("block_m", "block_n", "block_k"):
    _check_pow2(name, getattr(bs, name))
  step_k = _STEP_K.get(fmt, bs.block_k)
  if k % step_k:
    raise ValueError(f"{fmt} K step {step_k} must divide {k=}.")
  if bs.block_k % step_k or k % bs.block_k:
    raise ValueError(f"block_k={bs.block_k} must divide {k=} and be a multiple of the {fmt} K step {step_k}.")
  if n % bs.block_n:
    raise ValueError(f"block_n={bs.block_n} must divide {n=}.")
  return fmt, t, k, n, e


def _tile_groups(group_sizes: jax.Array, t_pad: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Group offsets [E+1] and, per row tile, the half-open range of groups that intersect it."""
  gs = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(gs)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  total = ends[-1]
  row0 = jnp.arange(t_pad // block_m, dtype=jnp.int32) * block_m
  last = jnp.minimum(row0 + block_m, total) - 1
  lo = jnp.searchsorted(ends, row0, side="right").astype(jnp.int32)
  hi = jnp.searchsorted(ends, last, side="right").astype(jnp.int32) + 1
  hi = jnp.where(row0 < total, hi, lo)              # tiles past the last token visit no group
  return offsets, lo, hi


def _unrolled(step_body, n_sub: int):
  """One loop iteration = `n_sub` unrolled sub-steps (longer straight-line code for Triton to pipeline)."""
  def body(i, acc):
    for j in range(n_sub):
      acc = step_body(i * n_sub + j, acc)
    return acc
  return body


def _kernel(offsets_ref, lo_ref, hi_ref, *refs, fmt: str, block_m: int, block_n: int, block_k: int, k: int):
  *in_refs, out_ref = refs
  m, n = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(m * block_m, block_m)
  cols = pl.ds(n * block_n, block_n)
  row_ids = m * block_m + jnp.arange(block_m, dtype=jnp.int32)

  if fmt == "bf16":
    lhs_ref, rhs_ref = in_refs

    def k_loop(g):
      def body(i, acc):
        a = lhs_ref[rows, pl.ds(i * block_k, block_k)]
        b = rhs_ref[g, pl.ds(i * block_k, block_k), cols]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)
      return jax.lax.fori_loop(0, k // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))

  elif fmt == "mxfp8":
    lq_ref, ls_ref, rq_ref, rs_ref = in_refs
    step = formats.MXFP8_BLOCK

    def k_loop(g):
      def body(i, acc):
        a = lq_ref[rows, pl.ds(i * step, step)]
        b = rq_ref[g, pl.ds(i * step, step), cols]
        sa = ls_ref[rows, pl.ds(i, 1)]                 # [bm, 1]
        sb = rs_ref[g, pl.ds(i, 1), cols]               # [1, bn]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32) * sa * sb
      return jax.lax.fori_loop(0, k // block_k, _unrolled(body, block_k // step), jnp.zeros((block_m, block_n),
                                                                                             jnp.float32))

  else:
    lp_ref, lbs_ref, lg_ref, rp_ref, rbs_ref, rg_ref = in_refs
    nb = _STEP_K["nvfp4"] // formats.NVFP4_BLOCK        # scale blocks per step
    pb = formats.NVFP4_BLOCK // 2                       # packed bytes per scale block

    def k_loop(g):
      def body(i, acc):
        pa = lp_ref[rows, pl.ds(i * nb * pb, nb * pb)]                    # [bm, 16] uint8
        sa = lbs_ref[rows, pl.ds(i * nb, nb)].astype(jnp.float32)         # [bm, 2]
        sa = jnp.broadcast_to(sa[:, :, None], (block_m, nb, pb)).reshape(block_m, nb * pb)
        pbt = rp_ref[g, pl.ds(i * nb * pb, nb * pb), cols]                # [16, bn] uint8
        sb = rbs_ref[g, pl.ds(i * nb, nb), cols].astype(jnp.float32)      # [2, bn]
        sb = jnp.broadcast_to(sb[:, None, :], (nb, pb, block_n)).reshape(nb * pb, block_n)
        # E2M1 x E4M3 products have <= 5 significant bits: exact in bf16.
        dec = lambda c, s: (formats.decode_e2m1(c) * s).astype(jnp.bfloat16)
        lo = jnp.dot(dec(pa & 15, sa), dec(pbt & 15, sb), preferred_element_type=jnp.float32)
        hi = jnp.dot(dec(pa >> 4, sa), dec(pbt >> 4, sb), preferred_element_type=jnp.float32)
        return acc + lo + hi
      sub = block_k // _STEP_K["nvfp4"]
      part = jax.lax.fori_loop(0, k // block_k, _unrolled(body, sub), jnp.zeros((block_m, block_n), jnp.float32))
      return part * lg_ref[rows, pl.ds(0, 1)] * rg_ref[g, pl.ds(0, 1), cols]

  def group_body(g, acc):
    keep = (row_ids >= offsets_ref[g]) & (row_ids < offsets_ref[g + 1])
    return acc + jnp.where(keep[:, None], k_loop(g), 0.0)

  acc = jax.lax.fori_loop(lo_ref[m], hi_ref[m], group_body, jnp.zeros((block_m, block_n), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def _operands(x, fmt: str, t_pad: int | None) -> list[jax.Array]:
  """Flattens an operand into kernel inputs; pads lhs rows to `t_pad` (None for rhs)."""
  if fmt == "bf16":
    arrs = [x]
  elif fmt == "mxfp8":
    # Triton has no E8M0 type; the scales are 1/32 of the data, so f32 costs little.
    arrs = [x.q, x.scale.astype(jnp.float32)]
  else:
    g_shape = x.packed.shape[:x.axis] + (1,) + x.packed.shape[x.axis + 1:]
    arrs = [x.packed, x.block_scale, jnp.broadcast_to(x.global_scale, g_shape).astype(jnp.float32)]
  if t_pad is not None and t_pad != arrs[0].shape[0]:
    arrs = [jnp.pad(a, ((0, t_pad - a.shape[0]), (0, 0))) for a in arrs]
  return arrs


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def grouped_matmul(lhs, rhs, group_sizes: jax.Array, *, out_dtype=jnp.bfloat16,
                   block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
  """Grouped matmul `out[t] = lhs[t] @ rhs[group(t)]` with f32 accumulation.

  Args:
    lhs: [T, K] tokens sorted by group: a bf16 (or f32) array, an `MXFP8Array` or an `NVFP4Array` (axis 1).
    rhs: [E, K, N] per-group weights in the same format as `lhs` (quantised along axis 1, K).
    group_sizes: [E] int rows per group; rows past their sum produce zeros.
    out_dtype: output dtype (bf16 or f32).
    block_sizes: tiles (None: `BlockSizes.default()`); shrunk to the problem by `BlockSizes.fit`.
    interpret: run the kernel in the Pallas interpreter (CPU).

  Returns:
    [T, N] in `out_dtype`.
  """
  bs = (block_sizes or BlockSizes.default()).fit(lhs.shape[0], lhs.shape[1], rhs.shape[2],
                                                 min_k=_STEP_K.get(_format_of(lhs), 16))
  fmt, t, k, n, _ = _validate(lhs, rhs, group_sizes, bs)
  t_pad = pl.cdiv(t, bs.block_m) * bs.block_m
  offsets, lo, hi = _tile_groups(group_sizes, t_pad, bs.block_m)
  if fmt == "bf16":
    dt = jnp.promote_types(lhs.dtype, rhs.dtype)
    lhs, rhs = lhs.astype(dt), rhs.astype(dt)
  inputs = _operands(lhs, fmt, t_pad) + _operands(rhs, fmt, None)
  kernel = functools.partial(_kernel, fmt=fmt, block_m=bs.block_m, block_n=bs.block_n, block_k=bs.block_k, k=k)
  out = pl.pallas_call(
      kernel,
      grid=(t_pad // bs.block_m, n // bs.block_n),
      in_specs=[pl.no_block_spec] * (3 + len(inputs)),
      out_specs=pl.BlockSpec((bs.block_m, bs.block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((t_pad, n), out_dtype),
      compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name=f"grouped_matmul_{fmt}",
  )(offsets, lo, hi, *inputs)
  return out[:t]


def grouped_matmul_reference(lhs, rhs, group_sizes: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
  """Plain-jnp reference: dequantise to f32 and sum one masked dense matmul per group."""
  x_TxK = formats.dequantize(lhs)
  w_ExKxN = formats.dequantize(rhs)
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  t_ids = jnp.arange(x_TxK.shape[0])
  onehot_TxE = (t_ids[:, None] >= starts[None, :]) & (t_ids[:, None] < ends[None, :])
  out = jnp.einsum("te,tk,ekn->tn", onehot_TxE.astype(jnp.float32), x_TxK, w_ExKxN,
                   precision=jax.lax.Precision.HIGHEST)
  return out.astype(out_dtype)
