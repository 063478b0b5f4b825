"""Our param pytree ↔ Hugging Face `DeepseekV3ForCausalLM` hub tensor names and layouts (numpy, host-side).

HF linears store [out, in]; ours store [in, out] with heads split out. `kv_a_proj_with_mqa` is our `kv_a` and
`k_rope` concatenated; `kv_b_proj` is `k_b` and `v_b` interleaved per head ([nope | v] for each head).
Routed experts use the per-expert hub names `mlp.experts.{e}.{gate,up,down}_proj.weight`.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.model.config import ModelConfig
from composer_jax.model.params import abstract_params


def attn_to_hf(p: dict, cfg: ModelConfig, xp=np) -> dict[str, np.ndarray]:
  """Attention params of one layer → {suffix under `self_attn.`: array}."""
  D, H = cfg.hidden_size, cfg.num_attention_heads
  C = cfg.kv_lora_rank
  out = {}
  if "q" in p:
    out["q_proj.weight"] = p["q"].reshape(D, -1).T
  else:
    out["q_a_proj.weight"] = p["q_a"].T
    out["q_a_layernorm.weight"] = p["q_a_norm"]
    out["q_b_proj.weight"] = p["q_b"].reshape(p["q_b"].shape[0], -1).T
  out["kv_a_proj_with_mqa.weight"] = xp.concatenate([p["kv_a"], p["k_rope"]], axis=1).T
  out["kv_a_layernorm.weight"] = p["kv_a_norm"]
  out["kv_b_proj.weight"] = xp.concatenate([p["k_b"], p["v_b"]], axis=2).reshape(C, -1).T
  out["o_proj.weight"] = p["o"].reshape(H * cfg.v_head_dim, D).T
  return out


def attn_from_hf(get: Callable[[str], np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Inverse of `attn_to_hf`; `get(suffix)` returns the HF tensor."""
  D, H, Q = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
  C, Qn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
  p = {}
  if cfg.q_lora_rank is None:
    p["q"] = get("q_proj.weight").T.reshape(D, H, Q)
  else:
    p["q_a"] = get("q_a_proj.weight").T
    p["q_a_norm"] = get("q_a_layernorm.weight")
    p["q_b"] = get("q_b_proj.weight").T.reshape(cfg.q_lora_rank, H, Q)
  kv_a = get("kv_a_proj_with_mqa.weight").T
  p["kv_a"], p["k_rope"] = kv_a[:, :C], kv_a[:, C:]
  p["kv_a_norm"] = get("kv_a_layernorm.weight")
  kv_b = get("kv_b_proj.weight").T.reshape(C, H, Qn + cfg.v_head_dim)
  p["k_b"], p["v_b"] = kv_b[..., :Qn], kv_b[..., Qn:]
  p["o"] = get("o_proj.weight").T.reshape(H, cfg.v_head_dim, D)
  return p


def _mlp_to_hf(p: dict) -> dict[str, np.ndarray]:
  return {f"{k}_proj.weight": p[k].T for k in ("gate", "up", "down")}


def _mlp_from_hf(get, prefix: str) -> dict[str, np.ndarray]:
  return {k: get(f"{prefix}{k}_proj.weight").T for k in ("gate", "up", "down")}


def block_to_hf(p: dict, cfg: ModelConfig, xp=np) -> dict[str, np.ndarray]:
  """One decoder layer → {suffix under `model.layers.{i}.`: array}."""
  out = {"input_layernorm.weight": p["attn_norm"], "post_attention_layernorm.weight": p["mlp_norm"]}
  out.update({f"self_attn.{k}": v for k, v in attn_to_hf(p["attn"], cfg, xp).items()})
  if "mlp" in p:
    out.update({f"mlp.{k}": v for k, v in _mlp_to_hf(p["mlp"]).items()})
    return out
  m = p["moe"]
  out["mlp.gate.weight"] = m["router"].T
  out["mlp.gate.e_score_correction_bias"] = m["bias"]
  for e in range(cfg.n_routed_experts):
    for k in ("gate", "up", "down"):
      out[f"mlp.experts.{e}.{k}_proj.weight"] = m[k][e].T
  if "shared" in m:
    out.update({f"mlp.shared_experts.{k}": v for k, v in _mlp_to_hf(m["shared"]).items()})
  return out


def block_from_hf(get, cfg: ModelConfig, moe: bool) -> dict:
  """Inverse of `block_to_hf`; `get(suffix)` returns the HF tensor under this layer's prefix."""
  p = {"attn_norm": get("input_layernorm.weight")}
  p["attn"] = attn_from_hf(lambda s: get(f"self_attn.{s}"), cfg)
  p["mlp_norm"] = get("post_attention_layernorm.weight")
  if not moe:
    p["mlp"] = _mlp_from_hf(get, "mlp.")
    return p
  m = {"router": get("mlp.gate.weight").T, "bias": get("mlp.gate.e_score_correction_bias")}
  for k in ("gate", "up", "down"):
    m[k] = np.stack([get(f"mlp.experts.{e}.{k}_proj.weight").T for e in range(cfg.n_routed_experts)])
  if cfg.n_shared_experts:
    m["shared"] = _mlp_from_hf(get, "mlp.shared_experts.")
  p["moe"] = m
  return p


def _unstack(tree, i):
  if isinstance(tree, dict):
    return {k: _unstack(v, i) for k, v in tree.items()}
  return tree[i]


def to_hf(params: dict, cfg: ModelConfig, xp=np) -> dict[str, np.ndarray]:
  """The full hub-name → array dict, MTP modules stored as layers num_hidden_layers + j (DeepSeek-V3 layout).

  With `xp=np` (saving) leaves are pulled to host numpy; with `xp=jax.numpy` it can run under `jax.eval_shape`.
  """
  if xp is np:
    params = _to_numpy(params)
  out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
  head_VxD = params["embed"] if cfg.tie_word_embeddings else params["lm_head"].T
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = head_VxD
  n_dense = cfg.first_k_dense_replace
  for i in range(cfg.num_hidden_layers):
    stack = params["dense_layers"] if i < n_dense else params["moe_layers"]
    blk = _unstack(stack, i if i < n_dense else i - n_dense)
    out.update({f"model.layers.{i}.{k}": v for k, v in block_to_hf(blk, cfg, xp).items()})
  for j in range(cfg.num_nextn_predict_layers):
    m = _unstack(params["mtp"], j)
    pre = f"model.layers.{cfg.num_hidden_layers + j}."
    out.update({pre + k: v for k, v in block_to_hf(m["block"], cfg, xp).items()})
    out[pre + "enorm.weight"] = m["enorm"]
    out[pre + "hnorm.weight"] = m["hnorm"]
    out[pre + "eh_proj.weight"] = m["eh_proj"].T
    out[pre + "shared_head.norm.weight"] = m["norm"]
    # DeepSeek-V3 checkpoints carry copies of the shared embedding and head in each MTP layer.
    out[pre + "embed_tokens.weight"] = params["embed"]
    out[pre + "shared_head.head.weight"] = head_VxD
  return {k: np.ascontiguousarray(v) for k, v in out.items()} if xp is np else out


def from_hf(get: Callable[[str], np.ndarray], cfg: ModelConfig) -> dict:
  """Builds our (unsharded, numpy) params from `get(hub_name)`; layers are stacked."""
  def stack(blocks):
    if isinstance(blocks[0], dict):
      return {k: stack([b[k] for b in blocks]) for k in blocks[0]}
    return np.stack(blocks)

  n_dense = cfg.first_k_dense_replace
  p = {"embed": get("model.embed_tokens.weight")}
  layer = lambda i, moe: block_from_hf(lambda s: get(f"model.layers.{i}.{s}"), cfg, moe)
  if n_dense:
    p["dense_layers"] = stack([layer(i, False) for i in range(n_dense)])
  if cfg.num_hidden_layers > n_dense:
    p["moe_layers"] = stack([layer(i, True) for i in range(n_dense, cfg.num_hidden_layers)])
  p["final_norm"] = get("model.norm.weight")
  if not cfg.tie_word_embeddings:
    p["lm_head"] = get("lm_head.weight").T
  if cfg.num_nextn_predict_layers:
    mods = []
    for j in range(cfg.num_nextn_predict_layers):
      i = cfg.num_hidden_layers + j
      g = lambda s, i=i: get(f"model.layers.{i}.{s}")
      mods.append({"enorm": g("enorm.weight"), "hnorm": g("hnorm.weight"), "eh_proj": g("eh_proj.weight").T,
                   "block": block_from_hf(g, cfg, True), "norm": g("shared_head.norm.weight")})
    p["mtp"] = stack(mods)
  return p


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every hub name a checkpoint for `cfg` must hold, with its shape (abstract: nothing is allocated)."""
  shapes = jax.eval_shape(lambda p: to_hf(p, cfg, xp=jnp), abstract_params(cfg))
  return {k: tuple(v.shape) for k, v in shapes.items()}


def _to_numpy(tree):
  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree)
