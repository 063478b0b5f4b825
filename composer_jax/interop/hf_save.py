"""`save`: our params → a `DeepseekV3ForCausalLM` checkpoint directory (plain or block-FP8), from one or many processes.

Each hub tensor is written by a process whose devices hold all of it (chosen round-robin among those that do), from
its local shards, with no communication: under expert parallelism across hosts each host writes its own experts.
Only tensors no process holds whole (e.g. FSDP splits them across hosts) are gathered (`process_allgather`, so every
process receives them) and written round-robin. Each process then writes its own files, one at a time.
"""
from __future__ import annotations

import itertools
import json
import math
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from composer_jax.interop import fp8 as fp8_lib
from composer_jax.interop.hf_config import config_to_hf
from composer_jax.interop.hf_files import INDEX_FILE, SINGLE_FILE
from composer_jax.interop.hf_names import HubTensor, block_of, hub_tensors, leaf_paths
from composer_jax.model.config import ModelConfig
from composer_jax.parallel import distributed


def _stored(name: str, hub: HubTensor, fmt: fp8_lib.BlockFP8 | None) -> int:
  """Bytes the tensor takes in the file (FP8: one per element plus its float32 scales)."""
  n = int(np.prod(hub.shape))
  if _quantised(name, fmt):
    return n + 4 * int(np.prod(fmt.scale_shape(hub.shape)))
  return n * hub.dtype.itemsize


def _quantised(name: str, fmt: fp8_lib.BlockFP8 | None) -> bool:
  return fmt is not None and fp8_lib.is_quantisable(name)


def _encode(name: str, x: np.ndarray, fmt: fp8_lib.BlockFP8 | None) -> dict[str, np.ndarray]:
  if not _quantised(name, fmt):
    return {name: x}
  q, scale = fp8_lib.quantize(x.astype(np.float32), fmt)
  return {name: q, name + fp8_lib.SCALE_SUFFIX: scale}



def _holders(x, n_stack: int) -> dict[tuple[int, ...], frozenset[int]] | None:
  """Stacked index → the processes whose devices hold all of `x[ix]` (None: a host array, every process has it)."""
  if not isinstance(x, jax.Array):
    return None
  full = math.prod(x.shape[n_stack:])
  groups: dict[int, dict] = {}
  for device, idx in x.sharding.devices_indices_map(x.shape).items():
    block = block_of(idx, x.shape)
    groups.setdefault(device.process_index, {}).setdefault(block[:n_stack], set()).add(block[n_stack:])
  out: dict[tuple[int, ...], set[int]] = {}
  for proc, by_stack in groups.items():
    for stack, inner in by_stack.items():   # the blocks tile the array: distinct blocks never overlap
      if sum(math.prod(b - a for a, b in blk) for blk in inner) == full:
        for ix in itertools.product(*[range(a, b) for a, b in stack]):
          out.setdefault(ix, set()).add(proc)
  return {ix: frozenset(p) for ix, p in out.items()}


def _local_block(x, ix: tuple[int, ...]) -> np.ndarray:
  """`x[ix]` from this process's shards (which must cover it), one device → host copy per shard."""
  if not isinstance(x, jax.Array):
    return np.asarray(x[ix])
  out = np.empty(x.shape[len(ix):], x.dtype)
  seen = set()
  for shard in x.addressable_shards:
    block = block_of(shard.index, x.shape)
    if block in seen or not all(a <= i < b for i, (a, b) in zip(ix, block)):
      continue
    seen.add(block)
    out[tuple(slice(a, b) for a, b in block[len(ix):])] = np.asarray(shard.data[tuple(i - a for i, (a, _) in
                                                                                         zip(ix, block))])
  return out


def _writers(hubs: dict[str, HubTensor], leaves: dict, n_proc: int) -> dict[str, int | None]:
  """Hub name → the process that writes it from local shards, or None (gathered, then written round-robin)."""
  held: dict = {}
  out = {}
  for k, name in enumerate(sorted(hubs)):
    procs = frozenset(range(n_proc))
    for path, ix, _ in hubs[name].parts:
      if path not in held:
        held[path] = _holders(leaves[path], len(ix))
      if held[path] is not None:
        procs &= held[path].get(ix, frozenset())
    out[name] = sorted(procs)[k % len(procs)] if procs else None
  return out


def _plan_files(hubs: dict[str, HubTensor], writers: dict[str, int | None], fmt, n_proc: int,
                max_shard_bytes: int) -> list[tuple[int, list[str]]]:
  """[(writer, names)] per file: each process's tensors (gathered ones round-robin) cut at `max_shard_bytes`."""
  gathered = [n for n in sorted(hubs) if writers[n] is None]
  mine = {p: [n for n in sorted(hubs) if writers[n] == p] for p in range(n_proc)}
  for k, name in enumerate(gathered):
    mine[k % n_proc].append(name)
  files = []
  for proc in range(n_proc):
    size, current = 0, []
    for name in sorted(mine[proc]):
      n = _stored(name, hubs[name], fmt)
      if current and size + n > max_shard_bytes:
        files.append((proc, current))
        size, current = 0, []
      current.append(name)
      size += n
    if current:
      files.append((proc, current))
  return files


def save(path: str, cfg: ModelConfig, params: dict, *, max_shard_bytes: int = 5 * 2**30,
         yarn_identity: bool = True, fp8: bool = False, fp8_block: tuple[int, int] = (128, 128)) -> list[str]:
  """Writes config.json and safetensors (sharded with an index when over `max_shard_bytes`) in hub layout.

  With `fp8`, attention and MLP / expert linear weights are written block-FP8 (E4M3 + float32 `_scale_inv` per
  `fp8_block`), as DeepSeek-V3 / Kimi K2 publish them. In a multi-process run every process calls `save` and writes
  its own files (see the module docstring); process 0 writes the index and config.json.

  Returns:
    The safetensors files this process wrote.
  """
  os.makedirs(path, exist_ok=True)
  fmt = fp8_lib.BlockFP8(tuple(fp8_block)) if fp8 else None
  hubs, leaves = hub_tensors(cfg), leaf_paths(params)
  me, n_proc = jax.process_index(), jax.process_count()
  writers = _writers(hubs, leaves, n_proc)
  files = _plan_files(hubs, writers, fmt, n_proc, max_shard_bytes)
  fnames = [SINGLE_FILE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                  for i in range(len(files))]

  def gather(p, ix):   # a collective: every process calls it, in the same order
    return multihost_utils.process_allgather(leaves[p][ix], tiled=True)

  weight_map, total, written = {}, 0, []
  for (proc, names), fname in zip(files, fnames):
    tensors: dict[str, np.ndarray] = {}
    for name in names:
      if writers[name] is None:
        x = hubs[name].assemble(gather)
      elif proc == me:
        x = hubs[name].assemble(lambda p, ix: _local_block(leaves[p], ix))
      else:
        continue
      if proc == me:
        tensors.update(_encode(name, x, fmt))
    if proc == me:
      save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
      written.append(fname)
    for name in names:
      weight_map[name] = fname
      if _quantised(name, fmt):
        weight_map[name + fp8_lib.SCALE_SUFFIX] = fname
      total += _stored(name, hubs[name], fmt)
  if me == 0:
    index = os.path.join(path, INDEX_FILE)
    if len(files) == 1:
      if os.path.exists(index):
        os.remove(index)
    else:
      with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(config_to_hf(cfg, yarn_identity=yarn_identity, fp8=fmt), f, indent=2, sort_keys=True)
  distributed.barrier("hf_save")
  return written
