"""The queue's storage format: one record = named numpy arrays + JSON metadata, in one self-checking blob.

Layout of a blob (little-endian):

  b"CJQ1" | u32 header_len | header (UTF-8 JSON) | array bytes, concatenated | u32 crc32 of everything before it

The magic's last byte is the format version (`VERSION`). A record from a newer writer (b"CJQ2", ...) raises
`NewerFormatError`, one that is truncated or damaged `CorruptRecordError`; both are `UnreadableRecordError`s, which
the queue consumer skips, counts apart and names in its log, so a mixed-version fleet or a torn write never stops
the trainer.

The header holds `meta` (any JSON value) and, per array, its name, stored dtype, shape, byte offset and, when it
was compacted, the original dtype and a row mask. Decoding checks magic, lengths and the checksum, so a truncated
or corrupt blob raises `CorruptRecordError` instead of returning garbage. The format knows nothing about
trajectories: a record that gains a field just gains an array or a metadata key.

Compaction (lossless): an integer array whose values fit in uint8 is stored as uint8 — e.g. routed experts when
E ≤ 256. If its only negative value is -1 filling whole rows along axis 0 ("not recorded", as the harness writes
for environment tokens), those rows are stored as 0 plus a packed-bit row mask and restored to -1 on decode.

`pack_tree`/`unpack_tree` flatten any nest of dicts/lists with numpy leaves (e.g. a list of `Trajectory.to_dict()`)
into such a record and back.
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np

VERSION = 1
MAGIC = b"CJQ" + str(VERSION).encode()
_ARRAY_TAG = "__array__"


class UnreadableRecordError(ValueError):
  """A stored record this reader cannot decode (see the two subclasses)."""


class CorruptRecordError(UnreadableRecordError):
  """A stored record is truncated or fails its checksum."""


class NewerFormatError(UnreadableRecordError):
  """A stored record was written by a newer codec version than this reader's `VERSION`."""


def _compact(a: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
  """Stores small non-negative integer arrays as uint8; -1 rows become a row mask (see module docstring)."""
  info: dict[str, Any] = {}
  if a.dtype.kind not in "iu" or a.dtype == np.uint8 or a.size == 0:
    return a, info
  lo, hi = int(a.min()), int(a.max())
  if hi > 255 or lo < -1:
    return a, info
  if lo == -1:
    if a.ndim == 0:
      return a, info
    rows = a.reshape(a.shape[0], -1)
    missing_R = (rows == -1).all(axis=1)
    if (rows[~missing_R] == -1).any():   # a partial row of -1: not the "unrecorded row" pattern
      return a, info
    a = np.where(missing_R.reshape((-1,) + (1,) * (a.ndim - 1)), 0, a)
    info["missing_rows"] = np.packbits(missing_R).tobytes().hex()
  info["orig_dtype"] = a.dtype.str
  return a.astype(np.uint8), info


def _expand(a: np.ndarray, info: dict[str, Any]) -> np.ndarray:
  if "orig_dtype" not in info:
    return a
  out = a.astype(np.dtype(info["orig_dtype"]))
  if "missing_rows" in info:
    missing_R = np.unpackbits(np.frombuffer(bytes.fromhex(info["missing_rows"]), np.uint8))[: a.shape[0]]
    out[missing_R.astype(bool)] = -1
  return out


def encode(arrays: dict[str, np.ndarray], meta: Any = None, *, compact: bool = True) -> bytes:
  """Serialises named arrays + JSON metadata into one blob (see the module docstring)."""
  entries, chunks, offset = [], [], 0
  for name, value in arrays.items():
    a = np.asarray(value)
    if a.dtype == object:
      raise TypeError(f"array {name!r} has dtype object; only numeric/bool arrays can be stored")
    a, info = _compact(a) if compact else (a, {})
    raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    entries.append({"name": name, "dtype": a.dtype.newbyteorder("<").str, "shape": list(a.shape),
                    "offset": offset, "nbytes": len(raw), **info})
    chunks.append(raw)
    offset += len(raw)
  try:
    header = json.dumps({"meta": meta, "arrays": entries}, allow_nan=True).encode()
  except TypeError as e:
    raise TypeError(f"record metadata is not JSON-serialisable: {e}") from e
  body = MAGIC + struct.pack("<I", len(header)) + header + b"".join(chunks)
  return body + struct.pack("<I", zlib.crc32(body))


def decode(blob: bytes) -> tuple[dict[str, np.ndarray], Any]:
  """Inverse of `encode`: (arrays, meta).

  Raises:
    NewerFormatError: the record names a codec version above `VERSION` (upgrade the reader).
    CorruptRecordError: anything else that is not a whole record of this version (truncated, damaged, foreign).
  """
  version = blob[3:4]
  if blob[:3] == MAGIC[:3] and version.isdigit() and int(version) > VERSION:
    raise NewerFormatError(f"queue record of codec version {int(version)}; this reader decodes version {VERSION}")
  if len(blob) < 12 or blob[:4] != MAGIC:
    raise CorruptRecordError(f"not a queue record (len={len(blob)}, magic={blob[:4]!r})")
  (crc,) = struct.unpack("<I", blob[-4:])
  if zlib.crc32(blob[:-4]) != crc:
    raise CorruptRecordError("record checksum mismatch (truncated or corrupted write)")
  (hlen,) = struct.unpack("<I", blob[4:8])
  try:   # a checksummed record is whole; a malformed header is a writer's bug, still never a reader's crash
    header = json.loads(blob[8:8 + hlen])
    data = memoryview(blob)[8 + hlen:-4]
    arrays = {}
    for e in header["arrays"]:
      raw = data[e["offset"]:e["offset"] + e["nbytes"]]
      a = np.frombuffer(raw, dtype=np.dtype(e["dtype"])).reshape(e["shape"]).copy()
      arrays[e["name"]] = _expand(a, e)
    return arrays, header["meta"]
  except (ValueError, KeyError, TypeError) as e:
    raise CorruptRecordError(f"record header does not describe its data: {e!r}") from None


def pack_tree(tree: Any) -> tuple[dict[str, np.ndarray], Any]:
  """Splits a nest of dicts/lists into (arrays by path, JSON skeleton with `{"__array__": path}` at array leaves)."""
  arrays: dict[str, np.ndarray] = {}

  def walk(x, path):
    if isinstance(x, np.ndarray):
      arrays[path] = x
      return {_ARRAY_TAG: path}
    if isinstance(x, dict):
      if _ARRAY_TAG in x:
        raise ValueError(f"key {_ARRAY_TAG!r} is reserved by the queue codec (at {path!r})")
      return {str(k): walk(v, f"{path}/{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [walk(v, f"{path}/{i}") for i, v in enumerate(x)]
    if isinstance(x, np.generic):
      return x.item()
    return x

  return arrays, walk(tree, "")


def unpack_tree(arrays: dict[str, np.ndarray], skeleton: Any) -> Any:
  """Inverse of `pack_tree` (tuples come back as lists)."""
  def walk(x):
    if isinstance(x, dict):
      if set(x) == {_ARRAY_TAG}:
        return arrays[x[_ARRAY_TAG]]
      return {k: walk(v) for k, v in x.items()}
    if isinstance(x, list):
      return [walk(v) for v in x]
    return x
  return walk(skeleton)
