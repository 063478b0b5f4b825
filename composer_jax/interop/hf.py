"""Load and save Hugging Face `DeepseekV3ForCausalLM` checkpoints (config.json + safetensors, optionally sharded).

`save` writes config.json the way real DeepSeek-V3 / Kimi K2 checkpoints do, so transformers and SGLang both load
it; MTP modules go to layer indices num_hidden_layers + j. `load` validates names and shapes before building params.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from composer_jax.interop.hf_names import expected_shapes, from_hf, to_hf
from composer_jax.model.config import ModelConfig, RopeScaling
from composer_jax.model.params import abstract_params, shardings
from composer_jax.parallel.rules import ShardingRules

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# HF config keys copied 1:1 to/from ModelConfig fields.
_SAME_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "rope_theta", "max_position_embeddings", "rms_norm_eps", "n_routed_experts",
              "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
              "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers",
              "tie_word_embeddings", "initializer_range", "rope_interleave")


def config_to_hf(cfg: ModelConfig, *, yarn_identity: bool = True) -> dict[str, Any]:
  """config.json dict in the DeepSeek-V3 / Kimi K2 layout.

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


def _open_tensors(path: str) -> dict[str, str]:
  """Map of tensor name → safetensors file holding it."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {k: os.path.join(path, v) for k, v in weight_map.items()}
  single = os.path.join(path, SINGLE_FILE)
  if not os.path.exists(single):
    raise FileNotFoundError(f"No {INDEX_FILE} or {SINGLE_FILE} in {path}")
  with safe_open(single, framework="np") as f:
    return dict.fromkeys(f.keys(), single)


def _check_names_and_shapes(cfg: ModelConfig, where: dict[str, str], optional: set[str]) -> None:
  want = expected_shapes(cfg)
  missing = sorted(set(want) - set(where) - optional)
  unexpected = sorted(set(where) - set(want))
  bad_shape = []
  handles: dict[str, Any] = {}
  for name in sorted(set(want) & set(where)):
    file = where[name]
    if file not in handles:
      handles[file] = safe_open(file, framework="np")
    got = tuple(handles[file].get_slice(name).get_shape())
    if got != want[name]:
      bad_shape.append(f"{name}: got {got}, expected {want[name]}")
  if missing or unexpected or bad_shape:
    def show(xs):
      return "\n  ".join(xs[:20]) + (f"\n  ... and {len(xs) - 20} more" if len(xs) > 20 else "")
    msg = ["Checkpoint does not match its config.json:"]
    if missing:
      msg.append(f"missing {len(missing)} tensor(s):\n  {show(missing)}")
    if unexpected:
      msg.append(f"unexpected {len(unexpected)} tensor(s):\n  {show(unexpected)}")
    if bad_shape:
      msg.append(f"mis-shaped {len(bad_shape)} tensor(s):\n  {show(bad_shape)}")
    raise ValueError("\n".join(msg))


def load(path: str, *, mesh=None, rules: ShardingRules | None = None, **config_overrides) -> tuple[ModelConfig, dict]:
  """Loads a `DeepseekV3ForCausalLM` checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or model.safetensors.index.json + shards).
    mesh, rules: where to place the params (default: a 1-device mesh, `ShardingRules()`).
    **config_overrides: ModelConfig fields to set on top of config.json (e.g. moe_impl, compute_dtype;
      num_nextn_predict_layers=0 drops the checkpoint's MTP modules).

  Returns:
    (cfg, params). Raises ValueError naming missing / unexpected / mis-shaped tensors.
  """
  with open(os.path.join(path, "config.json")) as f:
    file_cfg = config_from_hf(json.load(f))
  cfg = dataclasses.replace(file_cfg, **config_overrides)
  where = _open_tensors(path)
  # MTP modules the caller chose to drop (num_nextn_predict_layers overridden lower) are skipped, not an error.
  dropped = range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers,
                  file_cfg.num_hidden_layers + file_cfg.num_nextn_predict_layers)
  where = {k: v for k, v in where.items() if not any(k.startswith(f"model.layers.{i}.") for i in dropped)}
  # MTP layers' embed/head copies are redundant with the trunk's; checkpoints may omit them.
  optional = {n for n in expected_shapes(cfg)
              if n.endswith(("embed_tokens.weight", "shared_head.head.weight")) and n.startswith("model.layers.")}
  _check_names_and_shapes(cfg, where, optional)
  handles: dict[str, Any] = {}

  def get(name):
    file = where[name]
    if file not in handles:
      handles[file] = safe_open(file, framework="np")
    return handles[file].get_tensor(name)

  host = jax.tree.map(lambda a, s: np.asarray(a).astype(s.dtype), from_hf(get, cfg), abstract_params(cfg))
  return cfg, jax.device_put(host, shardings(cfg, mesh, rules))


def save(path: str, cfg: ModelConfig, params: dict, *, max_shard_bytes: int = 5 * 2**30,
         yarn_identity: bool = True) -> None:
  """Writes config.json and safetensors (sharded with an index when over `max_shard_bytes`) in hub layout."""
  os.makedirs(path, exist_ok=True)
  tensors = to_hf(params, cfg)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(tensors):
    n = tensors[name].nbytes
    if shards[-1] and size + n > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += n
  meta = {"format": "pt"}
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata=meta)
    stale = os.path.join(path, INDEX_FILE)
    if os.path.exists(stale):
      os.remove(stale)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(path, fname), metadata=meta)
      weight_map.update(dict.fromkeys(shard, fname))
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map},
                f, indent=2, sort_keys=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(cfg, yarn_identity=yarn_identity), f, indent=2, sort_keys=True)
