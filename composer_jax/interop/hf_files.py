"""A checkpoint directory's safetensors files: which file holds each tensor, and reads of rectangular regions.

Reads go through safetensors' `get_slice`, so only the requested rows/columns leave the (memory-mapped) file;
`Checkpoint.bytes_read` counts them (as stored: FP8 weights one byte per element, their scales four). Block-FP8
weights (see `fp8.py`) are dequantised to float32 region by region.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from composer_jax.interop import fp8 as fp8_lib

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors' numpy reader looks FP8 dtypes up as attributes of the numpy module, which numpy itself lacks;
# ml_dtypes (a jax dependency) provides the dtype.
if not hasattr(np, "float8_e4m3fn"):
  np.float8_e4m3fn = ml_dtypes.float8_e4m3fn


def open_safetensors(file: str):
  """`safe_open(file)`, or one error naming the file when it is truncated or corrupt (safetensors' own message
  names neither the file nor the likely cause)."""
  try:
    return safe_open(file, framework="np")
  except SafetensorError as e:
    size = os.path.getsize(file)
    raise ValueError(f"{file}: not a readable safetensors file ({size} bytes; {e}); it is truncated or corrupt — "
                     "an interrupted download or copy? Fetch it again.") from None


def tensor_files(path: str) -> dict[str, str]:
  """Map of tensor name → safetensors file holding it."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    absent = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(path, v))})
    if absent:
      raise FileNotFoundError(f"{index} names {len(absent)} file(s) that are not in {path}: {absent[:5]}")
    return {k: os.path.join(path, v) for k, v in weight_map.items()}
  single = os.path.join(path, SINGLE_FILE)
  if not os.path.exists(single):
    raise FileNotFoundError(f"No {INDEX_FILE} or {SINGLE_FILE} in {path}")
  with open_safetensors(single) as f:
    return dict.fromkeys(f.keys(), single)


class Checkpoint:
  """Region reads from a checkpoint's tensors (`where`: name → file), dequantising block-FP8 weights."""

  def __init__(self, where: dict[str, str], fmt: fp8_lib.BlockFP8 | None = None):
    self.where, self.fmt = where, fmt
    self.bytes_read = 0
    self._handles: dict[str, Any] = {}

  def _slice(self, name: str):
    file = self.where[name]
    if file not in self._handles:
      self._handles[file] = open_safetensors(file)
    return self._handles[file].get_slice(name)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._slice(name).get_shape())

  def dtype(self, name: str) -> str:
    """The stored dtype as safetensors names it ("F32", "BF16", "F8_E4M3", ...)."""
    return self._slice(name).get_dtype()

  def _read(self, name: str, ranges) -> np.ndarray:
    x = self._slice(name)[tuple(slice(a, b) for a, b in ranges)]
    self.bytes_read += x.nbytes
    return x

  def region(self, name: str, ranges: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Tensor `name` at [start, stop) per axis; block-FP8 weights come back dequantised to float32."""
    x = self._read(name, ranges)
    if x.dtype != fp8_lib.E4M3:
      return x
    scale = self._read(name + fp8_lib.SCALE_SUFFIX, fp8_lib.scale_ranges(self.fmt, *ranges))
    return fp8_lib.dequantize(x, scale, self.fmt, *ranges)


def _show(xs: list[str]) -> str:
  return "\n  ".join(xs[:20]) + (f"\n  ... and {len(xs) - 20} more" if len(xs) > 20 else "")


def check(ckpt: Checkpoint, want: dict[str, tuple[int, ...]], optional: set[str], notes: dict[str, str],
          hints: Callable[[], list[str]] = list) -> None:
  """Raises one ValueError listing missing / unexpected / mis-shaped tensors and bad FP8 scales.

  `notes` maps a missing tensor's name prefix to an explanation appended to the message; `hints()` gives lines
  put first (e.g. the config.json fields the tensors contradict).
  """
  names = set(ckpt.where)
  scales = {n for n in names if n.endswith(fp8_lib.SCALE_SUFFIX)}
  missing = sorted(set(want) - names - optional)
  unexpected = sorted(names - set(want) - scales)
  bad_shape, bad_fp8 = [], []
  for name in sorted(set(want) & names):
    got = ckpt.shape(name)
    if got != want[name]:
      bad_shape.append(f"{name}: got {got}, expected {want[name]}")
    elif ckpt.dtype(name) == "F8_E4M3":
      bad_fp8 += _check_fp8(ckpt, name, got)
  for s in sorted(scales):
    weight = s[:-len(fp8_lib.SCALE_SUFFIX)]
    if weight not in names or ckpt.dtype(weight) != "F8_E4M3":
      unexpected.append(f"{s} (a scale for {weight}, which is {'absent' if weight not in names else 'not FP8'})")
  if missing or unexpected or bad_shape or bad_fp8:
    where = os.path.dirname(next(iter(ckpt.where.values()), ""))
    msg = [f"Checkpoint {where} does not match its config.json:", *hints()]
    if missing:
      msg.append(f"missing {len(missing)} tensor(s):\n  {_show(missing)}")
      msg += [note for prefix, note in notes.items() if any(m.startswith(prefix) for m in missing)]
    if unexpected:
      msg.append(f"unexpected {len(unexpected)} tensor(s):\n  {_show(unexpected)}")
    if bad_shape:
      msg.append(f"mis-shaped {len(bad_shape)} tensor(s):\n  {_show(bad_shape)}")
    if bad_fp8:
      msg.append(f"bad FP8 weight(s) {len(bad_fp8)}:\n  {_show(bad_fp8)}")
    raise ValueError("\n".join(msg))


def _check_fp8(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> list[str]:
  if ckpt.fmt is None:
    return [f"{name}: stored as float8_e4m3fn but config.json has no quantization_config"]
  if len(shape) != 2 or not fp8_lib.is_quantisable(name):
    return [f"{name}: stored as float8_e4m3fn, but only attention / MLP / expert linear weights may be FP8"]
  scale = name + fp8_lib.SCALE_SUFFIX
  if scale not in ckpt.where:
    return [f"{name}: FP8 weight without its scale {scale}"]
  want = fp8_lib.BlockFP8.scale_shape(ckpt.fmt, shape)
  got = ckpt.shape(scale)
  if got != want:
    return [f"{scale}: got shape {got}, expected {want} (ceil({shape[0]}/{ckpt.fmt.block[0]}), "
            f"ceil({shape[1]}/{ckpt.fmt.block[1]}))"]
  if ckpt.dtype(scale) != "F32":
    return [f"{scale}: stored as {ckpt.dtype(scale)}, expected F32"]
  return []
