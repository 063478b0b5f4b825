"""The one description of the parameters: an `ArrayInfo` per leaf; init, shardings and counts derive from it.

Layout (nested dicts; `Ld` dense layers and `Lm` MoE layers are each stacked on a leading `layers` axis, `Nm` MTP
modules on a leading `mtp` axis):
  embed [V, D]; final_norm [D]; lm_head [D, V]
  dense_layers / moe_layers / mtp.block: attn_norm [D], mlp_norm [D], attn {...}, mlp {...} (dense) | moe {...}
  attn: q [D, H, Q] | (q_a [D, Rq], q_a_norm [Rq], q_b [Rq, H, Q]); kv_a [D, Rkv]; k_rope [D, R];
        kv_a_norm [Rkv]; k_b [Rkv, H, Qn]; v_b [Rkv, H, Dv]; o [H, Dv, D]
  mlp: gate [D, F], up [D, F], down [F, D]
  moe: router [D, E], bias [E] (e_score_correction_bias: selection only, trainer-updated), gate/up [E, D, Fe],
       down [E, Fe, D], shared {gate, up [D, Fs], down [Fs, D]} (Fs = n_shared_experts * Fe; absent if 0)
  mtp: enorm [D], hnorm [D], eh_proj [2D, D], block {as a MoE layer}, norm [D]

Letters: V vocab, D hidden, H heads, Q = Qn + R query/key head dim, Qn nope dim, R rope dim, Dv value head dim,
Rq q_lora_rank, Rkv kv_lora_rank, F dense ffw, Fe expert ffw, E routed experts.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from composer_jax.model.config import ModelConfig
from composer_jax.model.moe import check_moe_impl
from composer_jax.parallel.mesh import make_mesh
from composer_jax.parallel.rules import ShardingRules, logical_to_sharding


@dataclasses.dataclass(frozen=True)
class Normal:
  """N(0, std²) weights. A dataclass, not a closure, so `init` can draw every normal leaf in one random op."""
  std: float

  def __call__(self, key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    return (self.std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Constant:
  """A constant fill (norm scales 1, router biases 0); draws nothing."""
  value: float

  def __call__(self, key: jax.Array | None, shape: tuple[int, ...], dtype) -> jax.Array:
    del key
    return jnp.full(shape, self.value, dtype)


Initializer = Normal | Constant
ONES, ZEROS = Constant(1.0), Constant(0.0)
# Most elements one random draw may produce in `init`: leaves are packed into draws up to this size, so the extra
# float32 buffer stays bounded (256 MiB) even if a backend does not shard the draw like the leaves it feeds.
MAX_DRAW = 1 << 26


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """Abstract description of one parameter."""
  shape: tuple[int, ...]
  dtype: Any
  logical_axes: tuple[str | None, ...]
  initializer: Initializer

  def __post_init__(self):
    if len(self.shape) != len(self.logical_axes):
      raise ValueError(f"shape {self.shape} and logical_axes {self.logical_axes} differ in rank")


def _is_info(x) -> bool:
  return isinstance(x, ArrayInfo)


def validate_config(cfg: ModelConfig) -> None:
  """Raises a clear error for configs this implementation does not support."""
  if cfg.moe_layer_freq != 1:
    raise ValueError(f"moe_layer_freq={cfg.moe_layer_freq} is unsupported: DeepSeek-V3/Kimi use 1 (every layer "
                     "after first_k_dense_replace is MoE), which lets the MoE layers form one scanned stack")
  if not 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers:
    raise ValueError(f"first_k_dense_replace={cfg.first_k_dense_replace} must be in [0, {cfg.num_hidden_layers}]")
  if cfg.n_routed_experts % cfg.n_group:
    raise ValueError(f"n_group={cfg.n_group} must divide n_routed_experts={cfg.n_routed_experts}")
  if cfg.n_group > 1 and cfg.n_routed_experts // cfg.n_group < 2:
    raise ValueError("group-limited routing scores a group by its top-2 experts: need >= 2 experts per group, got "
                     f"{cfg.n_routed_experts // cfg.n_group}")
  if not 1 <= cfg.topk_group <= cfg.n_group:
    raise ValueError(f"topk_group={cfg.topk_group} must be in [1, n_group={cfg.n_group}]")
  if cfg.num_experts_per_tok > cfg.topk_group * (cfg.n_routed_experts // cfg.n_group):
    raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts in topk_group="
                     f"{cfg.topk_group} groups")
  if cfg.qk_rope_head_dim % 2:
    raise ValueError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even")
  check_moe_impl(cfg.moe_impl)
  if cfg.moe_matmul not in ("bf16", "mxfp8", "nvfp4") or cfg.moe_scale not in ("per_token", "per_tensor"):
    raise ValueError(f"moe_matmul={cfg.moe_matmul!r} (valid: 'bf16', 'mxfp8', 'nvfp4'), moe_scale={cfg.moe_scale!r} "
                     "(valid: 'per_token', 'per_tensor')")
  if cfg.moe_matmul != "bf16" and cfg.moe_impl not in ("auto", "ragged", "ep_ragged"):
    raise ValueError(f"moe_matmul={cfg.moe_matmul!r} needs moe_impl='ragged', 'ep_ragged' or 'auto' (grouped "
                     "matmuls), got "
                     f"{cfg.moe_impl!r}")
  if cfg.num_nextn_predict_layers and cfg.first_k_dense_replace == cfg.num_hidden_layers and cfg.n_routed_experts < 1:
    raise ValueError("MTP modules use a MoE block and need n_routed_experts >= 1")


def _attn_specs(cfg: ModelConfig, dt) -> dict[str, ArrayInfo]:
  D, H, Q = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
  std = cfg.initializer_range
  p = {}
  if cfg.q_lora_rank is None:
    p["q"] = ArrayInfo((D, H, Q), dt, ("embed", "heads", "head_dim"), Normal(std))
  else:
    p["q_a"] = ArrayInfo((D, cfg.q_lora_rank), dt, ("embed", "q_lora"), Normal(std))
    p["q_a_norm"] = ArrayInfo((cfg.q_lora_rank,), dt, ("norm",), ONES)
    p["q_b"] = ArrayInfo((cfg.q_lora_rank, H, Q), dt, ("q_lora_in", "heads", "head_dim"), Normal(std))
  p["kv_a"] = ArrayInfo((D, cfg.kv_lora_rank), dt, ("embed", "kv_lora"), Normal(std))
  p["k_rope"] = ArrayInfo((D, cfg.qk_rope_head_dim), dt, ("embed", "qk_rope"), Normal(std))
  p["kv_a_norm"] = ArrayInfo((cfg.kv_lora_rank,), dt, ("norm",), ONES)
  p["k_b"] = ArrayInfo((cfg.kv_lora_rank, H, cfg.qk_nope_head_dim), dt, ("kv_lora", "heads", "head_dim"), Normal(std))
  p["v_b"] = ArrayInfo((cfg.kv_lora_rank, H, cfg.v_head_dim), dt, ("kv_lora", "heads", "head_dim"), Normal(std))
  p["o"] = ArrayInfo((H, cfg.v_head_dim, D), dt, ("heads", "head_dim", "embed"), Normal(std))
  return p


def _mlp_specs(D: int, F: int, dt, std: float, ffw_axis: str) -> dict[str, ArrayInfo]:
  return {"gate": ArrayInfo((D, F), dt, ("embed", ffw_axis), Normal(std)),
          "up": ArrayInfo((D, F), dt, ("embed", ffw_axis), Normal(std)),
          "down": ArrayInfo((F, D), dt, (ffw_axis, "embed"), Normal(std))}


def _moe_specs(cfg: ModelConfig, dt) -> dict[str, Any]:
  D, E, Fe, std = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.initializer_range
  p = {
      # The router stays float32 (as in HF: `_keep_in_fp32_modules_strict`): selection is sensitive to rounding.
      "router": ArrayInfo((D, E), jnp.float32, ("embed", "router_experts"), Normal(std)),
      "bias": ArrayInfo((E,), jnp.float32, ("router_experts",), ZEROS),
      "gate": ArrayInfo((E, D, Fe), dt, ("experts", "expert_embed", "expert_ffw"), Normal(std)),
      "up": ArrayInfo((E, D, Fe), dt, ("experts", "expert_embed", "expert_ffw"), Normal(std)),
      "down": ArrayInfo((E, Fe, D), dt, ("experts", "expert_ffw", "expert_embed"), Normal(std)),
  }
  if cfg.n_shared_experts:
    p["shared"] = _mlp_specs(D, cfg.n_shared_experts * Fe, dt, std, "shared_ffw")
  return p


def _block_specs(cfg: ModelConfig, dt, moe: bool) -> dict[str, Any]:
  D = cfg.hidden_size
  p = {"attn_norm": ArrayInfo((D,), dt, ("norm",), ONES),
       "attn": _attn_specs(cfg, dt),
       "mlp_norm": ArrayInfo((D,), dt, ("norm",), ONES)}
  if moe:
    p["moe"] = _moe_specs(cfg, dt)
  else:
    p["mlp"] = _mlp_specs(D, cfg.intermediate_size, dt, cfg.initializer_range, "ffw")
  return p


def _stack(tree, n: int, axis_name: str):
  return jax.tree.map(lambda a: ArrayInfo((n, *a.shape), a.dtype, (axis_name, *a.logical_axes), a.initializer),
                      tree, is_leaf=_is_info)


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  """Returns the nested dict of `ArrayInfo` describing every parameter (see the module docstring)."""
  validate_config(cfg)
  dt = jnp.dtype(cfg.param_dtype)
  D, V, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
  n_dense = cfg.first_k_dense_replace
  n_moe = cfg.num_hidden_layers - n_dense
  p: dict[str, Any] = {"embed": ArrayInfo((V, D), dt, ("vocab", "embed"), Normal(std))}
  if n_dense:
    p["dense_layers"] = _stack(_block_specs(cfg, dt, moe=False), n_dense, "layers")
  if n_moe:
    p["moe_layers"] = _stack(_block_specs(cfg, dt, moe=True), n_moe, "layers")
  p["final_norm"] = ArrayInfo((D,), dt, ("norm",), ONES)
  if not cfg.tie_word_embeddings:
    p["lm_head"] = ArrayInfo((D, V), dt, ("embed", "vocab"), Normal(std))
  if cfg.num_nextn_predict_layers:
    mtp = {"enorm": ArrayInfo((D,), dt, ("norm",), ONES),
           "hnorm": ArrayInfo((D,), dt, ("norm",), ONES),
           "eh_proj": ArrayInfo((2 * D, D), dt, ("concat_embed", "embed"), Normal(std)),
           "block": _block_specs(cfg, dt, moe=True),
           "norm": ArrayInfo((D,), dt, ("norm",), ONES)}
    p["mtp"] = _stack(mtp, cfg.num_nextn_predict_layers, "mtp")
  return p


def shardings(cfg: ModelConfig, mesh=None, rules: ShardingRules | None = None):
  """The NamedSharding pytree matching `init(...)`'s output (dims a mesh axis does not divide are replicated)."""
  mesh = make_mesh({"data": 1}, devices=jax.devices()[:1]) if mesh is None else mesh
  rules = ShardingRules() if rules is None else rules
  return jax.tree.map(lambda a: logical_to_sharding(a.logical_axes, mesh, rules, a.shape), param_specs(cfg),
                      is_leaf=_is_info)


def init(key: jax.Array, cfg: ModelConfig, mesh=None, rules: ShardingRules | None = None) -> dict[str, Any]:
  """Initialises the params, jitted with `out_shardings` so every leaf is created already sharded.

  Args:
    key: PRNG key.
    cfg: model config.
    mesh: device mesh (default: a 1-device mesh).
    rules: logical-axis table (default `ShardingRules()`).

  Returns:
    The params pytree (nested dicts of arrays).
  """
  return jax.jit(functools.partial(init_values, cfg=cfg), out_shardings=shardings(cfg, mesh, rules))(key)


def _draw_groups(leaves: list[ArrayInfo]) -> list[list[int]]:
  """Indices of the normal leaves, packed in order into groups of at most MAX_DRAW elements (a bigger leaf alone)."""
  groups: list[list[int]] = []
  size = MAX_DRAW
  for i, a in enumerate(leaves):
    if not isinstance(a.initializer, Normal):
      continue
    n = math.prod(a.shape)
    if size + n > MAX_DRAW:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += n
  return groups


def init_values(key: jax.Array, cfg: ModelConfig) -> dict[str, Any]:
  """The params `init` returns, unjitted and unsharded (call it inside your own jit).

  All normal leaves come from one standard-normal draw (per MAX_DRAW elements), sliced and scaled per leaf: XLA
  compiles each random op separately, and one threefry per leaf (53 leaves) made the colab config's init compile
  in 36 s (2-core CPU, load ~13); one draw compiles in 2.8 s (load ~11; 5.7 s at load ~17).
  """
  leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=_is_info)
  out: list[jax.Array | None] = [None] * len(leaves)
  groups = _draw_groups(leaves)
  for k, group in zip(jax.random.split(key, max(len(groups), 1)), groups):
    z = jax.random.normal(k, (sum(math.prod(leaves[i].shape) for i in group),), jnp.float32)
    offset = 0
    for i in group:
      a = leaves[i]
      n = math.prod(a.shape)
      out[i] = (a.initializer.std * z[offset:offset + n].reshape(a.shape)).astype(a.dtype)
      offset += n
  for i, a in enumerate(leaves):
    if out[i] is None:
      out[i] = a.initializer(None, a.shape, a.dtype)
  return jax.tree.unflatten(treedef, out)


def abstract_params(cfg: ModelConfig):
  """ShapeDtypeStructs of the params, from `jax.eval_shape` (nothing allocated)."""
  specs = param_specs(cfg)
  return jax.eval_shape(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), specs, is_leaf=_is_info))


def count_params(cfg: ModelConfig) -> tuple[int, int]:
  """Returns (total, active) parameter counts, from the abstract description (nothing allocated).

  Both *exclude* the MTP modules (serving-only; DeepSeek-V3's published 671B excludes its 14B MTP module).
  `total` includes the embedding table and the LM head. `active` (weights used per token) counts
  `num_experts_per_tok` routed experts plus the shared experts and all other weights, including the LM head but not
  the input embedding table (a token reads one row of it). With these conventions DeepSeek-V3 gives 671.0B / 36.6B
  (published 671B / 37B) and Kimi K2 1.026T / 31.7B (published ~1.04T / 32B).
  """
  shapes = abstract_params(cfg)
  shapes = {k: v for k, v in shapes.items() if k != "mtp"}
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  routed = 0
  if "moe_layers" in shapes:
    routed = sum(math.prod(shapes["moe_layers"]["moe"][k].shape) for k in ("gate", "up", "down"))
  active = total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
  if not cfg.tie_word_embeddings:  # a tied table is the LM head too, so it stays active
    active -= math.prod(shapes["embed"].shape)
  return total, active
