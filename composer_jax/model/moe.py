"""DeepSeek-V3 MoE: sigmoid router with bias-corrected group-limited top-k, three expert compute paths.

Paths (`cfg.moe_impl`): `dense` (every expert on every token, one-hot combine; the readable reference), `ragged`
(sort assignments by expert, grouped matmul via `expert_matmul`, unsort), `capacity` (fixed [E, C, D] buffers;
assignments past an expert's capacity are dropped — the token still gets the shared expert and the residual), and
the expert-parallel `ep_capacity` / `ep_ragged` in `composer_jax.parallel.expert` (need a mesh: `jax.set_mesh`).

Letters: B batch, L length, T = B*L tokens, D hidden, E routed experts, K experts per token, F expert ffw,
G expert groups, C capacity per expert, M = T*K assignments.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import mlp
from kernels_pallas.moe_matmul import moe_matmul


def router_scores(p: dict, x_TxD: jax.Array) -> jax.Array:
  """Sigmoid affinity scores [T, E] in float32."""
  return jax.nn.sigmoid(x_TxD.astype(jnp.float32) @ p["router"].astype(jnp.float32))


def select_experts(scores_TxE: jax.Array, bias_E: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Top-k expert indices [T, K] by bias-corrected scores, restricted to the best `topk_group` groups.

  A group's score is the sum of its two best biased scores (DeepSeek-V3 `noaux_tc`); experts outside the chosen
  groups are masked to -inf as in HF. The bias only steers selection, never the gate weights.
  """
  biased_TxE = scores_TxE + bias_E.astype(jnp.float32)[None, :]
  T, E = biased_TxE.shape
  G = cfg.n_group
  if G > 1 and cfg.topk_group < G:
    group_TxG = jax.lax.top_k(biased_TxE.reshape(T, G, E // G), 2)[0].sum(-1)
    _, top_groups_TxKg = jax.lax.top_k(group_TxG, cfg.topk_group)
    keep_TxG = jax.nn.one_hot(top_groups_TxKg, G, dtype=jnp.int32).sum(1) > 0
    keep_TxE = jnp.repeat(keep_TxG, E // G, axis=1)
    biased_TxE = jnp.where(keep_TxE, biased_TxE, -jnp.inf)
  _, idx_TxK = jax.lax.top_k(biased_TxE, cfg.num_experts_per_tok)
  return idx_TxK.astype(jnp.int32)


def gate_weights(scores_TxE: jax.Array, idx_TxK: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Gate weights [T, K] from the unbiased scores at the chosen experts (normalised, times routed_scaling_factor)."""
  w_TxK = jnp.take_along_axis(scores_TxE, idx_TxK, axis=1)
  if cfg.norm_topk_prob:
    w_TxK = w_TxK / (w_TxK.sum(-1, keepdims=True) + 1e-20)
  return w_TxK * cfg.routed_scaling_factor


def expert_matmul(x_MxD: jax.Array, w_ExDxF: jax.Array, group_sizes_E: jax.Array,
                  cfg: ModelConfig | None = None) -> jax.Array:
  """Grouped matmul: rows of x, sorted by expert, times their expert's weight.

  `cfg.moe_matmul` "bf16" keeps `lax.ragged_dot` in the compute dtype; "mxfp8"/"nvfp4" quantise both operands
  (forward and backward) with `kernels_pallas.moe_matmul` (Pallas kernels on GPU, the jnp references elsewhere).
  """
  if cfg is None or cfg.moe_matmul == "bf16":
    return jax.lax.ragged_dot(x_MxD, w_ExDxF, group_sizes_E)
  return moe_matmul(x_MxD, w_ExDxF, group_sizes_E, matmul=cfg.moe_matmul, scale=cfg.moe_scale)


def _expert_weights(p: dict, dt) -> tuple[jax.Array, jax.Array, jax.Array]:
  return p["gate"].astype(dt), p["up"].astype(dt), p["down"].astype(dt)


def experts_dense(p: dict, x_TxD: jax.Array, idx_TxK: jax.Array, w_TxK: jax.Array) -> jax.Array:
  """Every expert on every token, combined with a one-hot [T, E] weight matrix."""
  gate, up, down = _expert_weights(p, x_TxD.dtype)
  T, E = x_TxD.shape[0], gate.shape[0]
  combine_TxE = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx_TxK].add(w_TxK)
  h_TxExF = jax.nn.silu(jnp.einsum("td,edf->tef", x_TxD, gate)) * jnp.einsum("td,edf->tef", x_TxD, up)
  y_TxExD = jnp.einsum("tef,efd->ted", h_TxExF, down)
  return jnp.einsum("ted,te->td", y_TxExD, combine_TxE.astype(x_TxD.dtype))


def experts_ragged(p: dict, x_TxD: jax.Array, idx_TxK: jax.Array, w_TxK: jax.Array,
                   cfg: ModelConfig | None = None) -> jax.Array:
  """Dropless: sort the T*K assignments by expert, grouped matmuls, weight, scatter-add back to tokens."""
  gate, up, down = _expert_weights(p, x_TxD.dtype)
  T, K = idx_TxK.shape
  E = gate.shape[0]
  expert_M = idx_TxK.reshape(-1)
  order_M = jnp.argsort(expert_M, stable=True)
  token_M = order_M // K
  sizes_E = jnp.bincount(expert_M, length=E).astype(jnp.int32)
  xs_MxD = x_TxD[token_M]
  h_MxF = jax.nn.silu(expert_matmul(xs_MxD, gate, sizes_E, cfg)) * expert_matmul(xs_MxD, up, sizes_E, cfg)
  ys_MxD = expert_matmul(h_MxF, down, sizes_E, cfg) * w_TxK.reshape(-1)[order_M][:, None].astype(x_TxD.dtype)
  return jnp.zeros_like(x_TxD).at[token_M].add(ys_MxD)


def capacity(cfg: ModelConfig, n_tokens: int) -> int:
  """Slots per expert: ceil(capacity_factor * T * K / E), at least 1."""
  return max(1, math.ceil(cfg.capacity_factor * n_tokens * cfg.num_experts_per_tok / cfg.n_routed_experts))


def capacity_dispatch(x_TxD: jax.Array, expert_M: jax.Array, valid_M: jax.Array, n_experts: int,
                      cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Scatters token copies into fixed [E, C, D] buffers; returns (buffer, slot [M], kept [M]).

  Assignment m = t*K + k goes to slot `pos` of its expert, `pos` its rank among the same expert's valid
  assignments in token (then top-k) order; ranks >= C and invalid (padding) assignments are not kept (slot E*C).
  The expert-parallel path (`composer_jax.parallel.expert`) dispatches each device's tokens with this same function.
  """
  M, K = expert_M.shape[0], expert_M.shape[0] // x_TxD.shape[0]
  E, C, D = n_experts, cap, x_TxD.shape[1]
  # Slot = rank among the same expert's valid assignments, in token order: a stable sort by expert gives it in
  # O(M log M) memory-light work (a cumsum over an [M, E] one-hot would not scale to many experts).
  key_M = jnp.where(valid_M, expert_M, E)
  order_M = jnp.argsort(key_M, stable=True)
  sorted_M = key_M[order_M]
  starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.bincount(key_M, length=E + 1))[:-1]])
  pos_M = jnp.zeros_like(expert_M).at[order_M].set(jnp.arange(M, dtype=expert_M.dtype) - starts[sorted_M])
  keep_M = valid_M & (pos_M < C)
  slot_M = jnp.where(keep_M, expert_M * C + pos_M, E * C)  # E*C: a dump row that is never read back as output
  token_M = jnp.arange(M) // K
  buf_ExCxD = jnp.zeros((E * C + 1, D), x_TxD.dtype).at[slot_M].set(x_TxD[token_M])[:E * C].reshape(E, C, D)
  return buf_ExCxD, slot_M, keep_M


def capacity_combine(y_ExCxD: jax.Array, slot_M: jax.Array, keep_M: jax.Array, w_M: jax.Array,
                     n_tokens: int) -> jax.Array:
  """Gathers each kept assignment's expert output from its slot, weights it by its gate and sums per token."""
  E, C, D = y_ExCxD.shape
  K = slot_M.shape[0] // n_tokens
  y_flat = jnp.concatenate([y_ExCxD.reshape(E * C, D), jnp.zeros((1, D), y_ExCxD.dtype)], axis=0)
  gate_M = jnp.where(keep_M, w_M, 0.0).astype(y_ExCxD.dtype)
  token_M = jnp.arange(n_tokens * K) // K
  return jnp.zeros((n_tokens, D), y_ExCxD.dtype).at[token_M].add(y_flat[slot_M] * gate_M[:, None])


def experts_capacity(p: dict, x_TxD: jax.Array, idx_TxK: jax.Array, w_TxK: jax.Array, valid_T: jax.Array,
                     capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """Fixed-size [E, C, D] dispatch; returns (output [T, D], fraction of valid assignments dropped).

  Slots are filled in token order (then top-k order); invalid (padding) tokens take no slot.
  """
  gate, up, down = _expert_weights(p, x_TxD.dtype)
  T, K = idx_TxK.shape
  E = gate.shape[0]
  C = max(1, math.ceil(capacity_factor * T * K / E))
  valid_M = jnp.repeat(valid_T, K)
  buf_ExCxD, slot_M, keep_M = capacity_dispatch(x_TxD, idx_TxK.reshape(-1), valid_M, E, C)
  h_ExCxF = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf_ExCxD, gate)) * jnp.einsum("ecd,edf->ecf", buf_ExCxD, up)
  y_ExCxD = jnp.einsum("ecf,efd->ecd", h_ExCxF, down)
  out_TxD = capacity_combine(y_ExCxD, slot_M, keep_M, w_TxK.reshape(-1), T)
  n_valid = jnp.maximum(valid_M.sum(), 1)
  dropped = (valid_M & ~keep_M).sum() / n_valid
  return out_TxD, dropped.astype(jnp.float32)


def sequence_balance_loss(scores_BxLxE: jax.Array, idx_BxLxK: jax.Array, valid_BxL: jax.Array) -> jax.Array:
  """DeepSeek-V3's sequence-wise balance loss sum_e f_e * P_e, averaged over rows (unweighted).

  Per row (a packed row counts as one sequence): f_e = E / (K * T) * #{t: e in topk(t)}, P_e = mean_t s'_{t,e}
  with s' the scores normalised over all experts; padding (invalid) tokens are excluded.
  """
  E, K = scores_BxLxE.shape[-1], idx_BxLxK.shape[-1]
  v_BxL = valid_BxL.astype(jnp.float32)
  n_B = jnp.maximum(v_BxL.sum(1), 1.0)
  s_norm = scores_BxLxE / scores_BxLxE.sum(-1, keepdims=True)
  P_BxE = (s_norm * v_BxL[..., None]).sum(1) / n_B[:, None]
  counts_BxE = (jax.nn.one_hot(idx_BxLxK, E, dtype=jnp.float32).sum(2) * v_BxL[..., None]).sum(1)
  f_BxE = counts_BxE * E / (K * n_B[:, None])
  return (f_BxE * P_BxE).sum(-1).mean()


def moe_block(p: dict, x_BxLxD: jax.Array, valid_BxL: jax.Array, cfg: ModelConfig,
              routing_BxLxK: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Routed experts + shared experts on x [B, L, D] (already normed).

  Args:
    p: this layer's `moe` params.
    x_BxLxD: input.
    valid_BxL: non-padding tokens (for load statistics, balance loss and capacity).
    cfg: model config.
    routing_BxLxK: optional replayed expert indices; gate weights are then recomputed from the current scores.

  Returns:
    (output [B, L, D], aux) with aux keys router_scores [B, L, E], experts [B, L, K] int32, expert_load [E],
    balance_loss (unweighted), dropped_fraction.
  """
  B, L, D = x_BxLxD.shape
  E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
  x_TxD = x_BxLxD.reshape(B * L, D)
  scores_TxE = router_scores(p, x_TxD)
  if routing_BxLxK is None:
    idx_TxK = select_experts(scores_TxE, jax.lax.stop_gradient(p["bias"]), cfg)
  else:
    if routing_BxLxK.shape != (B, L, K):
      raise ValueError(f"routing has shape {routing_BxLxK.shape}, expected {(B, L, K)} per MoE layer")
    idx_TxK = routing_BxLxK.reshape(B * L, K).astype(jnp.int32)
  w_TxK = gate_weights(scores_TxE, idx_TxK, cfg)
  dropped = jnp.zeros((), jnp.float32)
  if cfg.moe_impl == "dense":
    y_TxD = experts_dense(p, x_TxD, idx_TxK, w_TxK)
  elif cfg.moe_impl == "ragged":
    y_TxD = experts_ragged(p, x_TxD, idx_TxK, w_TxK, cfg)
  elif cfg.moe_impl == "capacity":
    y_TxD, dropped = experts_capacity(p, x_TxD, idx_TxK, w_TxK, valid_BxL.reshape(-1), cfg.capacity_factor)
  elif cfg.moe_impl in ("ep_capacity", "ep_ragged"):
    # Imported here: the expert-parallel module builds on this one's dispatch/combine and grouped matmul.
    from composer_jax.parallel.expert import expert_parallel
    y_TxD, dropped = expert_parallel(p, x_BxLxD, idx_TxK.reshape(B, L, K), w_TxK.reshape(B, L, K), valid_BxL, cfg)
  else:
    raise ValueError(f"moe_impl={cfg.moe_impl!r}; valid: 'dense', 'ragged', 'capacity', 'ep_capacity', 'ep_ragged'")
  y_BxLxD = y_TxD.reshape(B, L, D)
  if "shared" in p:
    y_BxLxD = y_BxLxD + mlp(p["shared"], x_BxLxD)
  scores_BxLxE = scores_TxE.reshape(B, L, E)
  idx_BxLxK = idx_TxK.reshape(B, L, K)
  load_E = (jax.nn.one_hot(idx_BxLxK, E, dtype=jnp.float32).sum(2) * valid_BxL[..., None]).sum((0, 1))
  aux = {"router_scores": scores_BxLxE, "experts": idx_BxLxK, "expert_load": load_E,
         "balance_loss": sequence_balance_loss(scores_BxLxE, idx_BxLxK, valid_BxL), "dropped_fraction": dropped}
  return y_BxLxD, aux
