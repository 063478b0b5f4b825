"""config.json (DeepSeek-V3 / Kimi K2 layout) ↔ `ModelConfig`."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from composer_jax.interop import fp8 as fp8_lib
from composer_jax.model.config import ModelConfig, RopeScaling

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
