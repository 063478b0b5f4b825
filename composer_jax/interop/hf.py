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
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from composer_jax.interop import fp8 as fp8_lib
from composer_jax.interop import hf_files
from composer_jax.interop.hf_files import INDEX_FILE, SINGLE_FILE
from composer_jax.interop.hf_names import HubTensor, Source, hub_tensors, leaf_paths, mtp_copies, read_block, sources
from composer_jax.model.config import ModelConfig, RopeScaling
from composer_jax.model.params import abstract_params, init, shardings
from composer_jax.parallel import distributed
from composer_jax.parallel.rules import ShardingRules

__all__ = ["INDEX_FILE", "SINGLE_FILE", "ReadStats", "config_from_hf", "config_to_hf", "load", "load_with_stats",
           "save"]
MISSING_MTP = ("init", "drop", "error")

# HF config keys copied 1:1 to/from ModelConfig fields.
_SAME_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "rope_theta", "max_position_embeddings", "rms_norm_eps", "n_routed_experts",
              "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
              "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers",
              "tie_word_embeddings", "initializer_range", "rope_interleave")


def config_to_hf(cfg: ModelConfig, *, yarn_identity: bool = True,
                 fp8: fp8_lib.BlockFP8 | None = None) -> dict[str, Any]:
  """config.json dict in the DeepSeek-V3 / Kimi K2 layout (with `fp8`, its `quantization_config` too).

  With `yarn_identity` and no rope scaling, writes a YaRN block with factor 1 (numerically plain RoPE) because
  SGLang's CPU rope factory only supports deepseek_yarn.
  """
  d: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
  d.update({k: getattr(cfg, k) for k in _SAME_KEYS})
  rs = cfg.rope_scaling
  if rs is None and yarn_identity:
    rs = RopeScaling(factor=1.0, original_max_position_embeddings=cfg.max_position_embeddings)
  if rs is not None:
    d["rope_scaling"] = {"type": "yarn", "factor": rs.factor, "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow,
                         "mscale": rs.mscale, "mscale_all_dim": rs.mscale_all_dim,
                         "original_max_position_embeddings": rs.original_max_position_embeddings}
  else:
    d["rope_scaling"] = None
  dtype = jax.numpy.dtype(cfg.param_dtype).name
  d.update({"num_key_value_heads": cfg.num_attention_heads, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "seq_aux": True,
            "aux_loss_alpha": cfg.seq_aux_loss_coef, "ep_size": 1, "use_cache": True, "bos_token_id": 0,
            "eos_token_id": 1, "torch_dtype": dtype, "dtype": dtype})
  if fp8 is not None:
    d["quantization_config"] = fp8.to_config()
  return d


def config_from_hf(d: dict[str, Any], **overrides) -> ModelConfig:
  """ModelConfig from a DeepSeek-V3 config.json dict; unsupported settings raise naming the key."""
  if d.get("model_type") not in ("deepseek_v3", "kimi_k2"):
    raise ValueError(f"config.json model_type={d.get('model_type')!r}; expected 'deepseek_v3'")
  checks = {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc", "attention_bias": False}
  for k, want in checks.items():
    if k in d and d[k] != want:
      raise ValueError(f"config.json {k}={d[k]!r} is unsupported (need {want!r})")
  if d.get("num_key_value_heads", d["num_attention_heads"]) != d["num_attention_heads"]:
    raise ValueError("config.json num_key_value_heads must equal num_attention_heads for MLA")
  kw = {k: d[k] for k in _SAME_KEYS if k in d}
  if "num_nextn_predict_layers" not in d and "num_mtp_layers" in d:
    kw["num_nextn_predict_layers"] = d["num_mtp_layers"]
  rs = d.get("rope_scaling") or d.get("rope_parameters")
  if rs and "rope_theta" in rs and "rope_theta" not in d:
    kw["rope_theta"] = rs["rope_theta"]
  kind = (rs or {}).get("type", (rs or {}).get("rope_type", "default"))
  if kind == "yarn":
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"type"}
    kw["rope_scaling"] = RopeScaling(**{k: v for k, v in rs.items() if k in fields})
  elif kind not in ("default", None):
    raise ValueError(f"rope scaling type {kind!r} is unsupported (only 'yarn')")
  if "aux_loss_alpha" in d:
    kw["seq_aux_loss_coef"] = d["aux_loss_alpha"]
  dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
  kw["param_dtype"] = dtype
  kw.update(overrides)
  return ModelConfig(**kw)


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


def _block_index(idx: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(idx, shape))


def _build_leaf(src: Source, aval, sharding, region, fresh: jax.Array | None, fresh_ix: tuple[int, ...]) -> jax.Array:
  """One leaf from this process's shards only: each distinct block its devices hold is read once.

  `fresh` (MTP leaves only) supplies stacked indices `fresh_ix` from a fresh init with the same sharding.
  """
  fresh_on = {s.device: np.asarray(s.data) for s in fresh.addressable_shards} if fresh is not None else {}
  blocks: dict = {}
  arrays = []
  for device, idx in sharding.addressable_devices_indices_map(aval.shape).items():
    block = _block_index(idx, aval.shape)
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
  if fresh_mtp:   # jit drops every leaf but MTP's from the full init, so nothing else is built
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
  with open(os.path.join(path, "config.json")) as f:
    d = json.load(f)
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
  hf_files.check(ckpt, want, optional, notes)
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


def _leaf_reader(params: dict):
  """`get(path, stack indices)` → that leaf block on this host. A leaf other processes hold parts of is gathered
  (every process must then make the same calls, in the same order); a local one is copied to host once."""
  leaves, host = leaf_paths(params), {}

  def get(path, ix):
    x = leaves[path]
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return multihost_utils.process_allgather(x[ix], tiled=True)
    if path not in host:
      host[path] = np.asarray(x)
    return host[path][ix]
  return get


def _plan_files(hubs: dict[str, HubTensor], fmt, max_shard_bytes: int) -> list[list[str]]:
  files: list[list[str]] = [[]]
  size = 0
  for name in sorted(hubs):
    n = _stored(name, hubs[name], fmt)
    if files[-1] and size + n > max_shard_bytes:
      files.append([])
      size = 0
    files[-1].append(name)
    size += n
  return files


def save(path: str, cfg: ModelConfig, params: dict, *, max_shard_bytes: int = 5 * 2**30,
         yarn_identity: bool = True, fp8: bool = False, fp8_block: tuple[int, int] = (128, 128)) -> None:
  """Writes config.json and safetensors (sharded with an index when over `max_shard_bytes`) in hub layout.

  With `fp8`, attention and MLP / expert linear weights are written block-FP8 (E4M3 + float32 `_scale_inv` per
  `fp8_block`), as DeepSeek-V3 / Kimi K2 publish them. In a multi-process run every process calls `save`: file k is
  written by process k % process_count, holding on its host one file's tensors at a time (each hub tensor is
  gathered from the processes that hold its parts); process 0 writes the index and config.json.
  """
  os.makedirs(path, exist_ok=True)
  fmt = fp8_lib.BlockFP8(tuple(fp8_block)) if fp8 else None
  hubs = hub_tensors(cfg)
  files = _plan_files(hubs, fmt, max_shard_bytes)
  fnames = [SINGLE_FILE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                  for i in range(len(files))]
  get, me, n_proc = _leaf_reader(params), jax.process_index(), jax.process_count()
  weight_map, total = {}, 0
  for k, names in enumerate(files):
    tensors: dict[str, np.ndarray] = {}
    for name in names:
      x = hubs[name].assemble(get)   # a collective where parts live on other processes: every process calls it
      if k % n_proc == me:
        tensors.update(_encode(name, x, fmt))
    if k % n_proc == me:
      save_file(tensors, os.path.join(path, fnames[k]), metadata={"format": "pt"})
    for name in names:
      weight_map[name] = fnames[k]
      if _quantised(name, fmt):
        weight_map[name + fp8_lib.SCALE_SUFFIX] = fnames[k]
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
