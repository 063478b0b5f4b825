"""DeepSeek-V3 MoE: sigmoid router with bias-corrected group-limited top-k, and the registry of expert paths.

`cfg.moe_impl` names one entry of `MOE_IMPLS` (or "auto": `blocked` on CPU, `ragged` elsewhere; see
`resolve_moe_impl`): `dense` (every expert on every token as two GEMMs; exact; the fastest at a few tokens per
step, so CPU decoding uses it), `blocked` (assignments sorted by expert into whole blocks, one batched GEMM; exact and
dropless; the fastest training path on XLA:CPU), `ragged` (sort by expert, `lax.ragged_dot` / the Pallas
grouped-matmul kernels; dropless; the GPU path), `capacity` (fixed [E, C, D]
buffers; overflow dropped — the token keeps the shared expert and the residual), and the expert-parallel
`ep_capacity` / `ep_ragged` (`expert_parallel.py`; need a mesh: `jax.set_mesh`). Adding a path: README.md.

Letters: B batch, L length, T = B·L tokens, D hidden, E routed experts, K experts per token, G expert groups,
Kg groups kept per token.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from composer_jax.model import expert_parallel, experts
from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import mlp
from composer_jax.parallel.rules import TOKENS, constrain, current_rules, mesh_axes_dividing


def router_scores(p: dict, x_TxD: jax.Array) -> jax.Array:
  """Sigmoid affinity scores [T, E] in float32."""
  return jax.nn.sigmoid(x_TxD.astype(jnp.float32) @ p["router"].astype(jnp.float32))


def top_k_per_device(x_TxE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k` over the last axis of [T, ..., E], run on each device's own tokens when a mesh is set.

  XLA's SPMD partitioner all-gathers a TopK's whole operand to every device (every token's router scores, 385 GB
  per step at Kimi K2 scale); in a `shard_map` over the token axes (`batch`, then `seq`, that divide T) each
  device selects for its own tokens. Identical results; without a mesh it is `lax.top_k`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return jax.lax.top_k(x_TxE, k)
  rules = current_rules()
  auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != jax.sharding.AxisType.Manual}
  T, axes = x_TxE.shape[0], []
  for logical in ("batch", "seq"):
    n = 1
    for a in axes:
      n *= mesh.shape[a]
    axes += [a for a in mesh_axes_dividing(logical, T // n, mesh, rules) if a in auto and a not in axes]
  if not axes:
    return jax.lax.top_k(x_TxE, k)
  spec = P(tuple(axes), *([None] * (x_TxE.ndim - 1)))
  return jax.shard_map(lambda s: tuple(jax.lax.top_k(s, k)), mesh=mesh, in_specs=spec, out_specs=(spec, spec),
                       axis_names=set(axes))(x_TxE)


def select_experts(scores_TxE: jax.Array, bias_E: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Top-k expert indices [T, K] by bias-corrected scores, restricted to the best `topk_group` groups.

  A group's score is the sum of its two best biased scores (DeepSeek-V3 `noaux_tc`); experts outside the chosen
  groups are masked to -inf as in HF. The bias only steers selection, never the gate weights.
  """
  biased_TxE = scores_TxE + bias_E.astype(jnp.float32)[None, :]
  T, E = biased_TxE.shape
  G = cfg.n_group
  if G > 1 and cfg.topk_group < G:
    group_TxG = top_k_per_device(biased_TxE.reshape(T, G, E // G), 2)[0].sum(-1)
    _, top_groups_TxKg = top_k_per_device(group_TxG, cfg.topk_group)
    keep_TxG = jax.nn.one_hot(top_groups_TxKg, G, dtype=jnp.int32).sum(1) > 0
    keep_TxE = jnp.repeat(keep_TxG, E // G, axis=1)
    biased_TxE = jnp.where(keep_TxE, biased_TxE, -jnp.inf)
  _, experts_TxK = top_k_per_device(biased_TxE, cfg.num_experts_per_tok)
  return experts_TxK.astype(jnp.int32)


def gate_weights(scores_TxE: jax.Array, experts_TxK: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Gate weights [T, K] from the unbiased scores at the chosen experts (normalised, times routed_scaling_factor)."""
  w_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=1)
  if cfg.norm_topk_prob:
    w_TxK = w_TxK / (w_TxK.sum(-1, keepdims=True) + 1e-20)
  return w_TxK * cfg.routed_scaling_factor


def sequence_balance_loss(scores_BxLxE: jax.Array, experts_BxLxK: jax.Array, valid_BxL: jax.Array) -> jax.Array:
  """DeepSeek-V3's sequence-wise balance loss sum_e f_e * P_e, averaged over rows (unweighted).

  Per row (a packed row counts as one sequence): f_e = E / (K * T) * #{t: e in topk(t)}, P_e = mean_t s'_{t,e}
  with s' the scores normalised over all experts; padding (invalid) tokens are excluded.
  """
  E, K = scores_BxLxE.shape[-1], experts_BxLxK.shape[-1]
  v_BxL = valid_BxL.astype(jnp.float32)
  n_B = jnp.maximum(v_BxL.sum(1), 1.0)
  s_norm = scores_BxLxE / scores_BxLxE.sum(-1, keepdims=True)
  P_BxE = (s_norm * v_BxL[..., None]).sum(1) / n_B[:, None]
  counts_BxE = (jax.nn.one_hot(experts_BxLxK, E, dtype=jnp.float32).sum(2) * v_BxL[..., None]).sum(1)
  f_BxE = counts_BxE * E / (K * n_B[:, None])
  return (f_BxE * P_BxE).sum(-1).mean()


# A path: (layer's moe params, x [B, L, D] normed, experts [T, K], gate weights [T, K], valid [B, L], cfg)
#   -> (routed output [T, D] without the shared experts, fraction of valid assignments dropped).
MoeImpl = Callable[[dict, jax.Array, jax.Array, jax.Array, jax.Array, ModelConfig], tuple[jax.Array, jax.Array]]


def _no_drops():
  # A function, not a module constant: an array built at import initialises the XLA backend, after which a
  # multi-process run can no longer call jax.distributed.initialize.
  return jnp.zeros((), jnp.float32)


def _dense(p, x_BxLxD, experts_TxK, w_TxK, valid_BxL, cfg):
  return experts.experts_dense(p, x_BxLxD.reshape(-1, x_BxLxD.shape[-1]), experts_TxK, w_TxK), _no_drops()


def _blocked(p, x_BxLxD, experts_TxK, w_TxK, valid_BxL, cfg):
  return experts.experts_blocked(p, x_BxLxD.reshape(-1, x_BxLxD.shape[-1]), experts_TxK, w_TxK), _no_drops()


def _ragged(p, x_BxLxD, experts_TxK, w_TxK, valid_BxL, cfg):
  return experts.experts_ragged(p, x_BxLxD.reshape(-1, x_BxLxD.shape[-1]), experts_TxK, w_TxK, cfg), _no_drops()


def _capacity(p, x_BxLxD, experts_TxK, w_TxK, valid_BxL, cfg):
  return experts.experts_capacity(p, x_BxLxD.reshape(-1, x_BxLxD.shape[-1]), experts_TxK, w_TxK,
                                  valid_BxL.reshape(-1), cfg.capacity_factor)


def _expert_parallel(p, x_BxLxD, experts_TxK, w_TxK, valid_BxL, cfg):
  B, L, D = x_BxLxD.shape
  K = experts_TxK.shape[-1]
  y_BxLxD, dropped = expert_parallel.expert_parallel(p, x_BxLxD, experts_TxK.reshape(B, L, K),
                                                     w_TxK.reshape(B, L, K), valid_BxL, cfg)
  return y_BxLxD.reshape(B * L, D), dropped


MOE_IMPLS: dict[str, MoeImpl] = {"dense": _dense, "blocked": _blocked, "ragged": _ragged, "capacity": _capacity,
                                 "ep_capacity": _expert_parallel, "ep_ragged": _expert_parallel}
# "auto" by platform: XLA:CPU runs `ragged_dot` as a masked dense dot plus sort/scatter glue; `blocked` does the
# routed FLOPs (plus block padding) as one batched GEMM, measured 3.1× `dense` per MoE layer forward + backward at
# the colab shape and 2.0× at the small one (where dense does 8× the routed work; alternating, 2 cores under load
# ~4), and ≈ dense at the RL model's 4 experts (2×): it is never slower. Accelerators keep the grouped matmuls.
AUTO_MOE_IMPL = {"cpu": "blocked"}
AUTO_MOE_IMPL_DEFAULT = "ragged"


def check_moe_impl(name: str) -> None:
  """Raises a ValueError listing the valid names unless `name` is "auto" or in `MOE_IMPLS`."""
  if name != "auto" and name not in MOE_IMPLS:
    raise ValueError(f"moe_impl={name!r}; valid: {['auto', *MOE_IMPLS]}")


def resolve_moe_impl(cfg: ModelConfig, platform: str | None = None) -> str:
  """The registry name `cfg.moe_impl` stands for: itself, or for "auto" the platform's (default:
  `jax.default_backend()`); "auto" with quantised expert matmuls (`moe_matmul` != "bf16") is always "ragged"."""
  check_moe_impl(cfg.moe_impl)
  if cfg.moe_impl != "auto":
    return cfg.moe_impl
  if cfg.moe_matmul != "bf16":
    return "ragged"
  return AUTO_MOE_IMPL.get(platform or jax.default_backend(), AUTO_MOE_IMPL_DEFAULT)


def moe_block(p: dict, x_BxLxD: jax.Array, valid_BxL: jax.Array, cfg: ModelConfig,
              routing_BxLxK: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Routed experts + shared experts on x [B, L, D] (already normed).

  Args:
    p: this layer's `moe` params.
    x_BxLxD: input.
    valid_BxL: non-padding tokens (for load statistics, balance loss and capacity).
    cfg: model config (`moe_impl` picks the path from `MOE_IMPLS`).
    routing_BxLxK: optional expert indices to replay; gate weights are then recomputed from the current scores.

  Returns:
    (output [B, L, D], aux) with aux keys router_scores [B, L, E], experts [B, L, K] int32, expert_load [E],
    balance_loss (unweighted), dropped_fraction.
  """
  B, L, D = x_BxLxD.shape
  E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
  x_BxLxD = constrain(x_BxLxD, TOKENS)
  x_TxD = x_BxLxD.reshape(B * L, D)
  # Scores and top-k stay on each device's own tokens (unconstrained, top_k gathered every token's scores).
  scores_TxE = constrain(router_scores(p, x_TxD).reshape(B, L, E), TOKENS).reshape(B * L, E)
  if routing_BxLxK is None:
    experts_TxK = select_experts(scores_TxE, jax.lax.stop_gradient(p["bias"]), cfg)
    experts_TxK = constrain(experts_TxK.reshape(B, L, K), TOKENS).reshape(B * L, K)
  else:
    if routing_BxLxK.shape != (B, L, K):
      raise ValueError(f"routing has shape {routing_BxLxK.shape}, expected {(B, L, K)} per MoE layer")
    experts_TxK = routing_BxLxK.reshape(B * L, K).astype(jnp.int32)
  w_TxK = gate_weights(scores_TxE, experts_TxK, cfg)
  impl = resolve_moe_impl(cfg)
  with jax.named_scope(f"experts_{impl}"):
    y_TxD, dropped = MOE_IMPLS[impl](p, x_BxLxD, experts_TxK, w_TxK, valid_BxL, cfg)
  y_BxLxD = constrain(y_TxD.reshape(B, L, D), TOKENS)
  if "shared" in p:
    y_BxLxD = y_BxLxD + mlp(p["shared"], x_BxLxD)
  scores_BxLxE = scores_TxE.reshape(B, L, E)
  experts_BxLxK = experts_TxK.reshape(B, L, K)
  load_E = (jax.nn.one_hot(experts_BxLxK, E, dtype=jnp.float32).sum(2) * valid_BxL[..., None]).sum((0, 1))
  aux = {"router_scores": scores_BxLxE, "experts": experts_BxLxK, "expert_load": load_E,
         "balance_loss": sequence_balance_loss(scores_BxLxE, experts_BxLxK, valid_BxL), "dropped_fraction": dropped}
  return y_BxLxD, aux
