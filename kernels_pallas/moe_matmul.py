"""Trainable low-precision MoE expert matmul: `lax.ragged_dot`'s signature, quantised forward and backward.

`moe_matmul(x_TxK, w_ExKxN, group_sizes, matmul=..., scale=...)` quantises both operands along K, runs the grouped
matmul, and has a `custom_vjp` whose backward computes both gradients by re-quantising the transposed operands
along their own contraction axis (the usual FP8/FP4 training recipe, straight-through for the rounding):

* `dx_TxK = dout_TxN @ w_ExNxK[group]`: `dout` quantised along N, `w.T` along N (grouped matmul);
* `dw_ExKxN = x_TxK[group].T @ dout_TxN[group]`: both quantised along T (transposed grouped matmul).

`backward="bf16"` runs both gradient matmuls in bf16 instead. `scale` chooses NVFP4's second-level FP32 scale:
`per_token` (one per row of each operand, the report's choice) or `per_tensor` (one per activation/gradient tensor,
one per expert matrix for weights); MXFP8 has only its power-of-two block scales, so `scale` does not affect it.

`impl="pallas"` runs the kernels (interpreted off GPU); `impl="reference"` runs the same quantised maths with the
plain-jnp references (and plain `lax.ragged_dot` for bf16), which is what CPU training uses; `"auto"` picks pallas
on GPU. Both share the quantisation code, so the kernel and reference differ only in the matmul itself.

Letters: T tokens (sorted by expert), K contraction, N output columns, E experts.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas import formats
from kernels_pallas.grouped_matmul import BlockSizes, grouped_matmul, grouped_matmul_reference
from kernels_pallas.transposed_grouped_matmul import (
  transposed_grouped_matmul,
  transposed_grouped_matmul_reference,
)

BACKWARD_MODES = ("quantized", "bf16")
IMPLS = ("auto", "pallas", "reference")
_T_ALIGN = 4 * formats.NVFP4_BLOCK                     # token padding so T-blocked scales tile whole steps


@dataclasses.dataclass(frozen=True)
class MoeMatmulConfig:
  """How the expert matmuls run; `matmul` in formats.FORMATS, `scale` in formats.SECOND_LEVEL_MODES."""
  matmul: str = "bf16"
  scale: str = "per_token"
  backward: str = "quantized"
  impl: str = "auto"
  interpret: bool | None = None                        # None: interpret unless running on GPU
  block_sizes: BlockSizes | None = None

  def __post_init__(self):
    for name, valid in (("matmul", formats.FORMATS), ("scale", formats.SECOND_LEVEL_MODES),
                        ("backward", BACKWARD_MODES), ("impl", IMPLS)):
      if getattr(self, name) not in valid:
        raise ValueError(f"Unknown moe {name}={getattr(self, name)!r}; valid: {valid}")

  def use_pallas(self) -> bool:
    return self.impl == "pallas" or (self.impl == "auto" and jax.default_backend() == "gpu")

  def run_interpreted(self) -> bool:
    return jax.default_backend() != "gpu" if self.interpret is None else self.interpret


def _gmm(cfg: MoeMatmulConfig, fmt: str, lhs, rhs, group_sizes, out_dtype):
  """Grouped matmul of high-precision operands, quantised to `fmt` along K."""
  if fmt == "bf16" and not cfg.use_pallas():
    return jax.lax.ragged_dot(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), group_sizes,
                              preferred_element_type=jnp.float32).astype(out_dtype)
  a = formats.quantize(lhs, fmt, axis=1, second_level=cfg.scale)
  b = formats.quantize(rhs, fmt, axis=1, second_level=cfg.scale, batch_dims=1)
  if cfg.use_pallas():
    return grouped_matmul(a, b, group_sizes, out_dtype=out_dtype, block_sizes=cfg.block_sizes,
                          interpret=cfg.run_interpreted())
  return grouped_matmul_reference(a, b, group_sizes, out_dtype=out_dtype)


def _tgmm(cfg: MoeMatmulConfig, fmt: str, lhs, rhs, group_sizes, out_dtype):
  """Transposed grouped matmul of high-precision operands, quantised to `fmt` along T."""
  pad = -lhs.shape[0] % _T_ALIGN
  if pad and fmt != "bf16":                            # zero rows past sum(group_sizes) are never read
    lhs, rhs = jnp.pad(lhs, ((0, pad), (0, 0))), jnp.pad(rhs, ((0, pad), (0, 0)))
  a = formats.quantize(lhs, fmt, axis=0, second_level=cfg.scale)
  b = formats.quantize(rhs, fmt, axis=0, second_level=cfg.scale)
  if cfg.use_pallas():
    return transposed_grouped_matmul(a, b, group_sizes, out_dtype=out_dtype, block_sizes=cfg.block_sizes,
                                     interpret=cfg.run_interpreted())
  return transposed_grouped_matmul_reference(a, b, group_sizes, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _moe_matmul(x_TxK, w_ExKxN, group_sizes, cfg: MoeMatmulConfig):
  return _gmm(cfg, cfg.matmul, x_TxK, w_ExKxN, group_sizes, x_TxK.dtype)


def _fwd(x_TxK, w_ExKxN, group_sizes, cfg):
  return _moe_matmul(x_TxK, w_ExKxN, group_sizes, cfg), (x_TxK, w_ExKxN, group_sizes)


def _bwd(cfg, res, dout_TxN):
  x_TxK, w_ExKxN, group_sizes = res
  fmt = cfg.matmul if cfg.backward == "quantized" else "bf16"
  dx_TxK = _gmm(cfg, fmt, dout_TxN, jnp.swapaxes(w_ExKxN, 1, 2), group_sizes, x_TxK.dtype)
  dw_ExKxN = _tgmm(cfg, fmt, x_TxK, dout_TxN, group_sizes, jnp.float32).astype(w_ExKxN.dtype)
  return dx_TxK, dw_ExKxN, None


_moe_matmul.defvjp(_fwd, _bwd)


def moe_matmul(x_TxK: jax.Array, w_ExKxN: jax.Array, group_sizes: jax.Array, *, matmul: str = "bf16",
               scale: str = "per_token", backward: str = "quantized", impl: str = "auto",
               interpret: bool | None = None, block_sizes: BlockSizes | None = None) -> jax.Array:
  """Drop-in for `lax.ragged_dot(x, w, group_sizes)` with a low-precision forward and backward.

  Args:
    x_TxK: tokens sorted by expert (f32 or bf16).
    w_ExKxN: expert weights.
    group_sizes: [E] int tokens per expert (sum <= T; rows past it give zeros and zero gradients).
    matmul: "bf16" | "mxfp8" | "nvfp4".
    scale: NVFP4 second-level scale, "per_token" | "per_tensor".
    backward: "quantized" (gradients re-quantised to `matmul`) | "bf16".
    impl: "pallas" | "reference" | "auto" (pallas on GPU, reference elsewhere).
    interpret: force the Pallas interpreter on/off (None: on unless on GPU).
    block_sizes: kernel tiles.

  Returns:
    [T, N] in `x_TxK.dtype`.
  """
  cfg = MoeMatmulConfig(matmul=matmul, scale=scale, backward=backward, impl=impl, interpret=interpret,
                        block_sizes=block_sizes)
  return _moe_matmul(x_TxK, w_ExKxN, group_sizes.astype(jnp.int32), cfg)
