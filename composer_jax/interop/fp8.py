"""Block-FP8 weights in the layout DeepSeek-V3 and Kimi K2 publish (host-side numpy).

Every attention and MLP / expert linear weight `W` [out, in] is stored as `float8_e4m3fn` next to a float32
`<name>_scale_inv` [ceil(out/128), ceil(in/128)]: `W ≈ W_fp8 * scale_inv` per 128 x 128 block (edge blocks are
partial). Embeddings, the LM head, norms, the router gate and its correction bias (and MTP's `eh_proj`) stay in higher
precision. config.json says so with
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                          "activation_scheme": "dynamic"}.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)   # 448
SCALE_SUFFIX = "_scale_inv"
# The hub-name endings of the weights the published checkpoints quantise (all under `model.layers.{i}.`).
QUANTISED_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight",
                      "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
                      "gate_proj.weight", "up_proj.weight", "down_proj.weight")


@dataclasses.dataclass(frozen=True)
class BlockFP8:
  """The quantisation a checkpoint's config.json declares (only block-wise E4M3 weights are supported)."""
  block: tuple[int, int] = (128, 128)

  def to_config(self) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block),
            "activation_scheme": "dynamic"}

  @classmethod
  def from_config(cls, d: dict[str, Any] | None) -> BlockFP8 | None:
    """Parses config.json's `quantization_config` (None: unquantised); anything else raises naming the key."""
    if not d:
      return None
    if d.get("quant_method") != "fp8":
      raise ValueError(f"config.json quantization_config.quant_method={d.get('quant_method')!r} is unsupported "
                       "(only 'fp8', the block-FP8 layout of DeepSeek-V3 / Kimi K2)")
    if d.get("fmt", "e4m3") != "e4m3":
      raise ValueError(f"config.json quantization_config.fmt={d['fmt']!r} is unsupported (only 'e4m3')")
    block = d.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
      raise ValueError(f"config.json quantization_config.weight_block_size={block!r}: need [rows, cols] (e.g. "
                       "[128, 128]); per-tensor FP8 is unsupported")
    if d.get("activation_scheme", "dynamic") != "dynamic":
      raise ValueError(f"config.json quantization_config.activation_scheme={d['activation_scheme']!r} is "
                       "unsupported (only 'dynamic': no activation scales are stored)")
    return cls(tuple(block))

  def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
    return tuple(-(-n // b) for n, b in zip(shape, self.block))


def is_quantisable(name: str) -> bool:
  """Whether the published layout stores hub tensor `name` in FP8."""
  return name.startswith("model.layers.") and name.endswith(QUANTISED_SUFFIXES)


def quantize(w: np.ndarray, fmt: BlockFP8) -> tuple[np.ndarray, np.ndarray]:
  """`w` [out, in] → (E4M3 weight, float32 scale_inv per block) with amax(block) mapped to 448."""
  (R, C), (br, bc) = w.shape, fmt.block
  nr, nc = fmt.scale_shape(w.shape)
  pad = np.zeros((nr * br, nc * bc), np.float32)
  pad[:R, :C] = w
  blocks = pad.reshape(nr, br, nc, bc)
  amax = np.abs(blocks).max(axis=(1, 3))
  scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)   # an all-zero block: any scale, zeros
  q = (blocks / scale[:, None, :, None]).reshape(nr * br, nc * bc)[:R, :C]
  return q.astype(E4M3), scale


def dequantize(q: np.ndarray, scale: np.ndarray, fmt: BlockFP8, rows: tuple[int, int],
               cols: tuple[int, int]) -> np.ndarray:
  """float32 values of the region `q` = W_fp8[rows, cols]; `scale` holds the scale blocks covering that region."""
  (br, bc), (r0, r1), (c0, c1) = fmt.block, rows, cols
  s = np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)
  s = s[r0 - (r0 // br) * br:, c0 - (c0 // bc) * bc:][:r1 - r0, :c1 - c0]
  return q.astype(np.float32) * s


def scale_ranges(fmt: BlockFP8, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[tuple[int, int], ...]:
  """The scale blocks covering a weight region ([start, stop) rows and columns of `<name>_scale_inv`)."""
  return tuple((a // b, -(-c // b)) for (a, c), b in zip((rows, cols), fmt.block))
