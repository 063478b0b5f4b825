"""Routed experts for decode steps as two plain matmuls over every expert ("all-experts" layout).

A decode step feeds a few tokens per row. `lax.ragged_dot` (the model's dropless path) is lowered on XLA:CPU to a
masked dense dot plus sorting and scatter glue, which costs ~50 us per call at any size below a few dozen tokens
(160-220 us per MoE layer on the colab config, 3/4 of a whole decode step). Here the experts' weights are laid out
once per generation call as one [D, 2*E*F] gate|up matrix and one [E*F, D] down matrix, every token goes through
every expert, and the gate weights (zero for unselected experts) scale the hidden before the down projection:

  y_t = sum_e g_te * down_e(silu(gate_e x_t) * up_e x_t)    with g_te = 0 unless e is among t's top-k experts,

the same function as `moe.moe_block` with the same routing (tested equal). It reads every expert once per step,
which is what a batch-1 decode step is bound by anyway (~25-40 us per MoE layer on the colab config at 1-3
tokens, and still faster than the CPU ragged path at 48 tokens). On GPUs keep the model's grouped-matmul path.

Letters: B batch, L new tokens, T = B*L tokens, D hidden, E routed experts, F expert ffw, K experts per token,
N layers of a stack.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.model import moe
from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import mlp


def _moe_layout(p: dict) -> dict:
  """A stack's `moe` params plus `gate_up` [N, D, 2*E*F] and `down_all` [N, E*F, D]."""
  N, E, D, F = p["gate"].shape
  gate_up = jnp.concatenate([jnp.transpose(p["gate"], (0, 2, 1, 3)), jnp.transpose(p["up"], (0, 2, 1, 3))], axis=2)
  return dict(p, gate_up=gate_up.reshape(N, D, 2 * E * F), down_all=p["down"].reshape(N, E * F, D))


def with_all_experts(params: dict) -> dict:
  """params with every MoE stack (trunk and MTP modules) also in the all-experts layout (run inside jit)."""
  out = dict(params)
  if "moe_layers" in params:
    out["moe_layers"] = dict(params["moe_layers"], moe=_moe_layout(params["moe_layers"]["moe"]))
  if "mtp" in params and "moe" in params["mtp"]["block"]:
    block = dict(params["mtp"]["block"], moe=_moe_layout(params["mtp"]["block"]["moe"]))
    out["mtp"] = dict(params["mtp"], block=block)
  return out


def moe_all_experts(p: dict, x_BxLxD: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """One layer's MoE on a few tokens via the all-experts layout → (output [B, L, D], experts [B, L, K] int32)."""
  B, L, D = x_BxLxD.shape
  E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
  dt = x_BxLxD.dtype
  x_TxD = x_BxLxD.reshape(B * L, D)
  scores_TxE = moe.router_scores(p, x_TxD)
  idx_TxK = moe.select_experts(scores_TxE, p["bias"], cfg)
  w_TxK = moe.gate_weights(scores_TxE, idx_TxK, cfg)
  T = B * L
  gates_TxE = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx_TxK].add(w_TxK)
  h_Tx2EF = x_TxD @ p["gate_up"].astype(dt)
  g_TxExF, u_TxExF = jnp.split(h_Tx2EF.reshape(T, 2 * E, -1), 2, axis=1)
  a_TxExF = jax.nn.silu(g_TxExF) * u_TxExF * gates_TxE[:, :, None].astype(dt)
  y_TxD = a_TxExF.reshape(T, -1) @ p["down_all"].astype(dt)
  y_BxLxD = y_TxD.reshape(B, L, D)
  if "shared" in p:
    y_BxLxD = y_BxLxD + mlp(p["shared"], x_BxLxD)
  return y_BxLxD, idx_TxK.reshape(B, L, K)
