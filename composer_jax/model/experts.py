"""Routed-expert compute paths on given routing: what `moe.MOE_IMPLS` dispatches to (a leaf module).

`experts_dense` (every expert on every token as two plain GEMMs; exact; the fastest at a few tokens, e.g. decode),
`experts_blocked` (assignments sorted by expert into whole blocks of rows, one batched GEMM over the blocks; exact
and dropless; the training path on XLA:CPU), `experts_ragged` (sort assignments by expert, grouped matmuls via
`expert_matmul`, unsort; dropless; the GPU path), and
`experts_capacity` (fixed [E, Ce, D] buffers; assignments past an expert's capacity are dropped). The
expert-parallel paths (`expert_parallel.py`) reuse `capacity_dispatch` / `slot_rows` + `combine_rows` / `expert_matmul`.

Letters: T tokens, D hidden, E routed experts, K experts per token, F expert ffw, Ce capacity per expert,
M = T·K assignments, b rows per block, N blocks, R = N·b padded rows.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from composer_jax.model.config import ModelConfig
from kernels_pallas.moe_matmul import moe_matmul


def _expert_weights(p: dict, dt) -> tuple[jax.Array, jax.Array, jax.Array]:
  return p["gate"].astype(dt), p["up"].astype(dt), p["down"].astype(dt)


def expert_matmul(x_MxD: jax.Array, w_ExDxF: jax.Array, group_sizes_E: jax.Array,
                  cfg: ModelConfig | None = None) -> jax.Array:
  """Grouped matmul: rows of x, sorted by expert, times their expert's weight.

  `cfg.moe_matmul` "bf16" keeps `lax.ragged_dot` in the compute dtype; "mxfp8"/"nvfp4" quantise both operands
  (forward and backward) with `kernels_pallas.moe_matmul` (Pallas kernels on GPU, the jnp references elsewhere).
  """
  if cfg is None or cfg.moe_matmul == "bf16":
    return jax.lax.ragged_dot(x_MxD, w_ExDxF, group_sizes_E)
  return moe_matmul(x_MxD, w_ExDxF, group_sizes_E, matmul=cfg.moe_matmul, scale=cfg.moe_scale)


def gate_matrix(experts_TxK: jax.Array, w_TxK: jax.Array, n_experts: int) -> jax.Array:
  """[T, E] float32 gate weights: g[t, e] = w[t, k] where idx[t, k] = e, else 0."""
  T = experts_TxK.shape[0]
  return jnp.zeros((T, n_experts), jnp.float32).at[jnp.arange(T)[:, None], experts_TxK].add(w_TxK.astype(jnp.float32))


def experts_dense(p: dict, x_TxD: jax.Array, experts_TxK: jax.Array, w_TxK: jax.Array) -> jax.Array:
  """Every expert on every token as two plain GEMMs, exact (unselected experts get gate 0):

    y_t = sum_e g_te * down_e(silu(gate_e x_t) * up_e x_t)

  One [T, D] @ [D, E·2F] GEMM gives every expert's gate and up projections, the gates g [T, E] scale the hidden
  before one [T, E·F] @ [E·F, D] GEMM that sums over experts. E/K times the ragged path's FLOPs, but plain GEMMs:
  on XLA:CPU (where `ragged_dot` runs as a masked dense dot plus sort/gather/scatter glue anyway) it is ~2× faster
  per layer forward + backward at the colab shape, and it is the fastest decode path at a few tokens per step.
  """
  E, D, F = p["gate"].shape[-3:]
  T = x_TxD.shape[0]
  gu_DxEx2F = (p["gate_up"] if "gate_up" in p else dense_layout(p)["gate_up"]).astype(x_TxD.dtype)
  down = p["down"].astype(x_TxD.dtype)
  h_TxEx2F = (x_TxD @ gu_DxEx2F).reshape(T, E, 2 * F)
  g_TxE = gate_matrix(experts_TxK, w_TxK, E).astype(x_TxD.dtype)
  a_TxExF = jax.nn.silu(h_TxEx2F[..., :F]) * h_TxEx2F[..., F:] * g_TxE[:, :, None]
  return a_TxExF.reshape(T, E * F) @ down.reshape(E * F, D)


def dense_layout(p: dict) -> dict:
  """A layer's (or a stack's: leading axes are kept) `moe` params plus `gate_up` [..., D, E·2F], the layout
  `experts_dense`'s first GEMM reads.

  Training relays the weights inside each step (a copy of the expert weights, small next to the GEMMs). A decode
  loop runs thousands of tiny steps with fixed weights: lay them out once per generation call, outside the loop
  (`with_dense_layout`); at batch 1 the per-step copy would cost more than the layer's matmuls.
  """
  *lead, E, D, F = p["gate"].shape
  n = len(lead)
  gu = jnp.concatenate([p["gate"], p["up"]], axis=-1)                       # [..., E, D, 2F]
  gu = jnp.moveaxis(gu, n, n + 1).reshape(*lead, D, E * 2 * F)               # [..., D, E·2F]
  return dict(p, gate_up=gu)


def with_dense_layout(params: dict) -> dict:
  """params with every MoE stack (trunk and MTP modules) carrying `dense_layout` (call inside jit, once)."""
  out = dict(params)
  if "moe_layers" in params:
    out["moe_layers"] = dict(params["moe_layers"], moe=dense_layout(params["moe_layers"]["moe"]))
  if "mtp" in params and "moe" in params["mtp"]["block"]:
    block = params["mtp"]["block"]
    out["mtp"] = dict(params["mtp"], block=dict(block, moe=dense_layout(block["moe"])))
  return out


def block_rows(n_assignments: int, n_experts: int) -> int:
  """`experts_blocked`'s rows per block, from an expert's mean load m = M / E: a quarter of it as a power of two,
  kept in [128, 512] (but never above m itself, down to 8).

  The path computes N·b = M + E·b rows whatever the routing (N = M/b + E blocks is the static bound), so a smaller
  block wastes fewer rows on padding and a larger one runs better GEMMs. Measured on XLA:CPU (one layer forward +
  backward, alternating, 2 cores under load ~4): b = 128 beat 32, 64 and 256 at the colab shape (m = 512) and 32 and
  64 at the small one (m = 128, where it pads M by 2×); 512 beat 128 and 256 at the RL model's SFT batch (m = 2048).
  """
  m = max(n_assignments // n_experts, 1)
  pow2 = lambda v: 2 ** int(math.log2(max(v, 1)))   # noqa: E731
  return int(max(8, min(pow2(m), max(128, min(512, pow2(m / 4))))))


def experts_blocked(p: dict, x_TxD: jax.Array, experts_TxK: jax.Array, w_TxK: jax.Array,
                    block: int | None = None) -> jax.Array:
  """Dropless and exact, at ~(M + E·b)/M times the active FLOPs (the dense path's is E/K):

    sort the M = T·K assignments by expert; expert e's n_e rows fill ceil(n_e / b) whole blocks of b rows (the
    last one zero-padded); one batched GEMM over the N = ceil(M / b) + E blocks, each with its expert's weights
    gathered; each assignment's output row, times its gate, summed per token.

  Unused blocks hold zero rows (their outputs are never read), so every routing takes the same static shapes. On
  XLA:CPU this beats both `experts_dense` (which multiplies every token by all E experts) and `ragged_dot` (a
  masked dense dot there) once T·K / E is a few dozen rows or more; `block` defaults to `block_rows(M, E)`.
  """
  T, K = experts_TxK.shape
  E, D, F = p["gate"].shape
  M = T * K
  b = block or block_rows(M, E)
  N = -(-M // b) + E
  expert_M = experts_TxK.reshape(-1)
  sizes_E = jnp.bincount(expert_M, length=E).astype(jnp.int32)
  blocks_E = -(-sizes_E // b)
  block_end_E = jnp.cumsum(blocks_E)
  row_start_E = (block_end_E - blocks_E) * b                           # expert e's first padded row
  order_M = jnp.argsort(expert_M, stable=True)
  sorted_M = expert_M[order_M]
  rank_M = jnp.arange(M, dtype=jnp.int32) - (jnp.cumsum(sizes_E) - sizes_E)[sorted_M]
  row_M = jnp.zeros(M, jnp.int32).at[order_M].set(row_start_E[sorted_M] + rank_M)   # assignment m's padded row
  token_R = jnp.full(N * b, T, jnp.int32).at[row_M].set(jnp.arange(M, dtype=jnp.int32) // K)   # T: a zero row
  x_RxD = jnp.concatenate([x_TxD, jnp.zeros((1, D), x_TxD.dtype)])[token_R]
  expert_N = jnp.minimum(jnp.searchsorted(block_end_E, jnp.arange(N), side="right"), E - 1)
  gate_up_ExDx2F = jnp.concatenate([p["gate"], p["up"]], axis=-1).astype(x_TxD.dtype)
  h_NxBx2F = jnp.einsum("nbd,ndf->nbf", x_RxD.reshape(N, b, D), gate_up_ExDx2F[expert_N])
  a_NxBxF = jax.nn.silu(h_NxBx2F[..., :F]) * h_NxBx2F[..., F:]
  y_RxD = jnp.einsum("nbf,nfd->nbd", a_NxBxF, p["down"].astype(x_TxD.dtype)[expert_N]).reshape(N * b, D)
  y_TxKxD = y_RxD[row_M].reshape(T, K, D)
  return jnp.einsum("tkd,tk->td", y_TxKxD, w_TxK.astype(x_TxD.dtype))


def experts_ragged(p: dict, x_TxD: jax.Array, experts_TxK: jax.Array, w_TxK: jax.Array,
                   cfg: ModelConfig | None = None) -> jax.Array:
  """Dropless: sort the T*K assignments by expert, grouped matmuls, weight, scatter-add back to tokens."""
  gate, up, down = _expert_weights(p, x_TxD.dtype)
  T, K = experts_TxK.shape
  E = gate.shape[0]
  expert_M = experts_TxK.reshape(-1)
  order_M = jnp.argsort(expert_M, stable=True)
  token_M = order_M // K
  sizes_E = jnp.bincount(expert_M, length=E).astype(jnp.int32)
  xs_MxD = x_TxD[token_M]
  h_MxF = jax.nn.silu(expert_matmul(xs_MxD, gate, sizes_E, cfg)) * expert_matmul(xs_MxD, up, sizes_E, cfg)
  ys_MxD = expert_matmul(h_MxF, down, sizes_E, cfg) * w_TxK.reshape(-1)[order_M][:, None].astype(x_TxD.dtype)
  return jnp.zeros_like(x_TxD).at[token_M].add(ys_MxD)


def capacity(capacity_factor: float, n_tokens: int, k: int, n_experts: int) -> int:
  """Slots per expert: ceil(capacity_factor * T * K / E), at least 1 (the one-device and expert-parallel paths)."""
  return max(1, math.ceil(capacity_factor * n_tokens * k / n_experts))


def capacity_dispatch(x_TxD: jax.Array, expert_M: jax.Array, valid_M: jax.Array, n_experts: int,
                      cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Scatters token copies into fixed [E, Ce, D] buffers; returns (buffer, slot [M], kept [M]).

  Assignment m = t*K + k goes to slot `pos` of its expert, `pos` its rank among the same expert's valid
  assignments in token (then top-k) order; ranks >= Ce and invalid (padding) assignments are not kept (slot E*Ce).
  The expert-parallel path (`expert_parallel.py`) dispatches each device's tokens with this same function.
  """
  M, K = expert_M.shape[0], expert_M.shape[0] // x_TxD.shape[0]
  E, Ce, D = n_experts, cap, x_TxD.shape[1]
  # Slot = rank among the same expert's valid assignments, in token order: a stable sort by expert gives it in
  # O(M log M) memory-light work (a cumsum over an [M, E] one-hot would not scale to many experts).
  key_M = jnp.where(valid_M, expert_M, E)
  order_M = jnp.argsort(key_M, stable=True)
  sorted_M = key_M[order_M]
  starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.bincount(key_M, length=E + 1))[:-1]])
  pos_M = jnp.zeros_like(expert_M).at[order_M].set(jnp.arange(M, dtype=expert_M.dtype) - starts[sorted_M])
  keep_M = valid_M & (pos_M < Ce)
  slot_M = jnp.where(keep_M, expert_M * Ce + pos_M, E * Ce)  # E*Ce: a dump row that is never read back as output
  token_M = jnp.arange(M) // K
  buf_ExCexD = jnp.zeros((E * Ce + 1, D), x_TxD.dtype).at[slot_M].set(x_TxD[token_M])[:E * Ce].reshape(E, Ce, D)
  return buf_ExCexD, slot_M, keep_M


def capacity_combine(y_ExCexD: jax.Array, slot_M: jax.Array, keep_M: jax.Array, w_M: jax.Array,
                     n_tokens: int) -> jax.Array:
  """Gathers each kept assignment's expert output from its slot, weights it by its gate and sums per token."""
  return combine_rows(slot_rows(y_ExCexD, slot_M), keep_M, w_M, n_tokens)


def slot_rows(y_ExCexD: jax.Array, slot_M: jax.Array) -> jax.Array:
  """Each assignment's expert output [M, D] from its slot (zeros for a dropped one, whose slot is E·Ce)."""
  E, Ce, D = y_ExCexD.shape
  y_flat = jnp.concatenate([y_ExCexD.reshape(E * Ce, D), jnp.zeros((1, D), y_ExCexD.dtype)], axis=0)
  return y_flat[slot_M]


def combine_rows(y_MxD: jax.Array, keep_M: jax.Array, w_M: jax.Array, n_tokens: int) -> jax.Array:
  """Σ_k gate · output per token, over the assignments' rows [M = T·K, D] in token order."""
  K = y_MxD.shape[0] // n_tokens
  gate_M = jnp.where(keep_M, w_M, 0.0).astype(y_MxD.dtype)
  token_M = jnp.arange(n_tokens * K) // K
  return jnp.zeros((n_tokens, y_MxD.shape[1]), y_MxD.dtype).at[token_M].add(y_MxD * gate_M[:, None])


def experts_capacity(p: dict, x_TxD: jax.Array, experts_TxK: jax.Array, w_TxK: jax.Array, valid_T: jax.Array,
                     capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """Fixed-size [E, Ce, D] dispatch; returns (output [T, D], fraction of valid assignments dropped).

  Slots are filled in token order (then top-k order); invalid (padding) tokens take no slot.
  """
  gate, up, down = _expert_weights(p, x_TxD.dtype)
  T, K = experts_TxK.shape
  E = gate.shape[0]
  Ce = capacity(capacity_factor, T, K, E)
  valid_M = jnp.repeat(valid_T, K)
  buf_ExCexD, slot_M, keep_M = capacity_dispatch(x_TxD, experts_TxK.reshape(-1), valid_M, E, Ce)
  h_ExCexF = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf_ExCexD, gate)) * jnp.einsum("ecd,edf->ecf", buf_ExCexD, up)
  y_ExCexD = jnp.einsum("ecf,efd->ecd", h_ExCexF, down)
  out_TxD = capacity_combine(y_ExCexD, slot_M, keep_M, w_TxK.reshape(-1), T)
  n_valid = jnp.maximum(valid_M.sum(), 1)
  dropped = (valid_M & ~keep_M).sum() / n_valid
  return out_TxD, dropped.astype(jnp.float32)
