"""Load and save Hugging Face `DeepseekV3ForCausalLM` checkpoints (config.json + safetensors, optionally sharded).

`save` writes config.json the way real DeepSeek-V3 / Kimi K2 checkpoints do, so transformers and SGLang both load
it; MTP modules go to layer indices num_hidden_layers + j; `fp8=True` writes the published block-FP8 layout.
`load` validates names, shapes and FP8 scales, then each process reads from the safetensors files only the
rows/columns its devices hold under the run's `ShardingRules` (block-FP8 weights dequantised to the param dtype) and
assembles its arrays with `jax.make_array_from_single_device_arrays`. See composer_jax/interop/README.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings

import jax
import numpy as np

from composer_jax.interop import fp8 as fp8_lib
from composer_jax.interop import hf_files, hf_mismatch
from composer_jax.interop.hf_config import config_from_hf, config_to_hf
from composer_jax.interop.hf_files import INDEX_FILE, SINGLE_FILE
from composer_jax.interop.hf_names import Source, block_of, hub_tensors, leaf_paths, mtp_copies, read_block, sources
from composer_jax.interop.hf_save import save
from composer_jax.model.config import ModelConfig
from composer_jax.model.params import abstract_params, init, shardings
from composer_jax.parallel.rules import ShardingRules

__all__ = ["INDEX_FILE", "SINGLE_FILE", "ReadStats", "config_from_hf", "config_to_hf", "load", "load_with_stats",
           "save"]
MISSING_MTP = ("init", "drop", "error")


@dataclasses.dataclass(frozen=True)
class ReadStats:
  """What one process's `load` did: bytes it read from the files (as stored) and MTP modules it initialised fresh."""
  bytes_read: int
  fresh_mtp: tuple[int, ...] = ()


def _mtp_prefix(cfg: ModelConfig, j: int) -> str:
  return f"model.layers.{cfg.num_hidden_layers + j}."


def _missing_mtp_modules(cfg: ModelConfig, names: set[str]) -> list[int]:
  """MTP modules of which the checkpoint holds no tensor (the embed/head copies do not count)."""
  copies = set(mtp_copies(cfg))
  return [j for j in range(cfg.num_nextn_predict_layers)
          if not any(n.startswith(_mtp_prefix(cfg, j)) and n not in copies for n in names)]


def _resolve_missing_mtp(cfg: ModelConfig, missing: list[int], policy: str) -> tuple[ModelConfig, tuple[int, ...]]:
  """(config to load, MTP modules to initialise fresh) for modules the checkpoint lacks entirely, with a warning."""
  if policy not in MISSING_MTP:
    raise ValueError(f"missing_mtp={policy!r}; valid: {MISSING_MTP}")
  if not missing or policy == "error":
    return cfg, ()
  n = cfg.num_nextn_predict_layers
  where = ", ".join(f"{j} ({_mtp_prefix(cfg, j)}*)" for j in missing)
  head = (f"The checkpoint has no tensors for MTP module(s) {where} although config.json sets "
          f"num_nextn_predict_layers={n} (transformers' save_pretrained writes no MTP weights). ")
  if policy == "drop":
    if missing != list(range(n - len(missing), n)):
      raise ValueError(head + "missing_mtp='drop' can only drop trailing modules; use missing_mtp='init'")
    warnings.warn(head + f"Dropped them (missing_mtp='drop'): num_nextn_predict_layers={n - len(missing)}. Pass "
                  "missing_mtp='init' to initialise them fresh instead.", stacklevel=3)
    return dataclasses.replace(cfg, num_nextn_predict_layers=n - len(missing)), ()
  warnings.warn(head + "Initialised them fresh (missing_mtp='init', the default). Pass missing_mtp='drop' (or "
                "num_nextn_predict_layers=0) to load without them, or missing_mtp='error' to refuse.", stacklevel=3)
  return cfg, tuple(missing)



def _build_leaf(src: Source, aval, sharding, region, fresh: jax.Array | None, fresh_ix: tuple[int, ...]) -> jax.Array:
  """One leaf from this process's shards only: each distinct block its devices hold is read once.

  `fresh` (MTP leaves only) supplies stacked indices `fresh_ix` from a fresh init with the same sharding.
  """
  fresh_on = {s.device: np.asarray(s.data) for s in fresh.addressable_shards} if fresh is not None else {}
  blocks: dict = {}
  arrays = []
  for device, idx in sharding.addressable_devices_indices_map(aval.shape).items():
    block = block_of(idx, aval.shape)
    if block not in blocks:
      (j0, j1), rest = (block[0], block[1:]) if fresh_ix else ((0, 0), ())
      if fresh_ix:   # module by module: fresh ones from the init's local shard, the others from the files
        blocks[block] = np.stack([fresh_on[device][j - j0] if j in fresh_ix else
                                  read_block(src, ((j, j + 1), *rest), region, aval.dtype)[0] for j in range(j0, j1)])
      else:
        blocks[block] = read_block(src, block, region, aval.dtype)
    arrays.append(jax.device_put(blocks[block], device))
  return jax.make_array_from_single_device_arrays(aval.shape, sharding, arrays)


def read_params(ckpt: hf_files.Checkpoint, cfg: ModelConfig, mesh=None, rules: ShardingRules | None = None, *,
                fresh_mtp: tuple[int, ...] = (), seed: int = 0) -> dict:
  """Params for `cfg` placed on `mesh` under `rules`, each process reading only its devices' blocks from `ckpt`."""
  avals = leaf_paths(abstract_params(cfg))
  placed = leaf_paths(shardings(cfg, mesh, rules))
  srcs = sources(cfg)
  fresh = {}
  if fresh_mtp:   # under jit only the random draws the MTP leaves use are computed (the rest is dead code)
    mtp_shardings = shardings(cfg, mesh, rules)["mtp"]
    fresh = leaf_paths({"mtp": jax.jit(lambda k: init(k, cfg, mesh, rules)["mtp"], out_shardings=mtp_shardings)(
        jax.random.key(seed))})
  out = {}
  for path, aval in avals.items():
    if path in fresh and len(fresh_mtp) == cfg.num_nextn_predict_layers:
      out[path] = fresh[path]
    else:
      out[path] = _build_leaf(srcs[path], aval, placed[path], ckpt.region, fresh.get(path),
                              fresh_mtp if path in fresh else ())
  tree: dict = {}
  for path, x in out.items():
    node = tree
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = x
  return tree


def load_with_stats(path: str, *, mesh=None, rules: ShardingRules | None = None, missing_mtp: str = "init",
                    seed: int = 0, **config_overrides) -> tuple[ModelConfig, dict, ReadStats]:
  """`load`, also returning what this process read (`ReadStats`)."""
  config_path = os.path.join(path, "config.json")
  with open(config_path) as f:
    try:
      d = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{config_path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
  file_cfg = config_from_hf(d)
  fmt = fp8_lib.BlockFP8.from_config(d.get("quantization_config"))
  cfg = dataclasses.replace(file_cfg, **config_overrides)
  where = hf_files.tensor_files(path)
  # MTP modules the caller chose to drop (num_nextn_predict_layers overridden lower) are skipped, not an error.
  dropped = [_mtp_prefix(cfg, j) for j in range(cfg.num_nextn_predict_layers, file_cfg.num_nextn_predict_layers)]
  where = {k: v for k, v in where.items() if not k.startswith(tuple(dropped))}
  cfg, fresh = _resolve_missing_mtp(cfg, _missing_mtp_modules(cfg, set(where)), missing_mtp)
  want = {k: v.shape for k, v in hub_tensors(cfg).items()}
  optional = set(mtp_copies(cfg)) | {n for n in want if n.startswith(tuple(_mtp_prefix(cfg, j) for j in fresh))}
  notes = {_mtp_prefix(cfg, j): (f"{_mtp_prefix(cfg, j)}* is MTP module {j} (config.json "
                                 f"num_nextn_predict_layers={file_cfg.num_nextn_predict_layers}); a module missing "
                                 "entirely can be initialised fresh (missing_mtp='init') or dropped "
                                 "(missing_mtp='drop' / num_nextn_predict_layers=0), a partial one cannot")
           for j in range(cfg.num_nextn_predict_layers)}
  ckpt = hf_files.Checkpoint(where, fmt)
  hf_files.check(ckpt, want, optional, notes, lambda: hf_mismatch.disagreements(cfg, set(where), ckpt.shape))
  params = read_params(ckpt, cfg, mesh, rules, fresh_mtp=fresh, seed=seed)
  return cfg, params, ReadStats(ckpt.bytes_read, fresh)


def load(path: str, *, mesh=None, rules: ShardingRules | None = None, missing_mtp: str = "init", seed: int = 0,
         **config_overrides) -> tuple[ModelConfig, dict]:
  """Loads a `DeepseekV3ForCausalLM` checkpoint directory (plain or block-FP8), reading only this process's shards.

  Args:
    path: directory with config.json and model.safetensors (or model.safetensors.index.json + shards).
    mesh, rules: where to place the params (default: a 1-device mesh, `ShardingRules()`). Each process reads only
      the blocks its devices hold (experts split by expert parallelism only where they live).
    missing_mtp: MTP modules config.json declares but the checkpoint lacks entirely (transformers' save_pretrained
      writes none): 'init' (default) initialises them fresh from `seed`, 'drop' lowers num_nextn_predict_layers,
      'error' refuses. Either way a warning names them; a partially present module is always an error.
    seed: PRNG seed of freshly initialised MTP modules.
    **config_overrides: ModelConfig fields to set on top of config.json (e.g. moe_impl, compute_dtype;
      num_nextn_predict_layers=0 drops the checkpoint's MTP modules).

  Returns:
    (cfg, params). Raises ValueError naming missing / unexpected / mis-shaped tensors and bad FP8 scales.
  """
  cfg, params, _ = load_with_stats(path, mesh=mesh, rules=rules, missing_mtp=missing_mtp, seed=seed,
                                   **config_overrides)
  return cfg, params


