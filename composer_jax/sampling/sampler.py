"""Per-row sampling distributions (temperature, top-k, top-p) and the logprobs an RL trainer recomputes.

Two distributions per row:
  * the *sampling* distribution: softmax(logits / T) restricted to the top-k tokens and then to the smallest set
    of most likely tokens whose mass reaches top-p (renormalised); T = 0 is greedy (all mass on the argmax);
  * the *policy* distribution the trainer recomputes from its forward: log_softmax(logits / T) over the full
    vocabulary (T = 0 scores at T = 1). This is what the engine returns as each token's logprob; truncation by
    top-k/top-p is a sampling choice the trainer's loss does not see (as SGLang/vLLM return logprobs).

Letters: B batch, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _safe_temperature(temperature_B: jax.Array) -> jax.Array:
  return jnp.where(temperature_B > 0, temperature_B, 1.0).astype(jnp.float32)


def policy_logprobs(logits_BxV: jax.Array, temperature_B: jax.Array) -> jax.Array:
  """log_softmax(logits / T) [B, V]; rows with T == 0 use T = 1."""
  return jax.nn.log_softmax(logits_BxV.astype(jnp.float32) / _safe_temperature(temperature_B)[:, None], axis=-1)


def entropy(logprobs_BxV: jax.Array) -> jax.Array:
  """Entropy [B] (nats) of each row's distribution given as log-probabilities (-inf entries contribute 0)."""
  return -jnp.sum(jnp.where(jnp.isfinite(logprobs_BxV), jnp.exp(logprobs_BxV) * logprobs_BxV, 0.0), axis=-1)


def policy_entropy(logits_BxV: jax.Array, temperature_B: jax.Array) -> jax.Array:
  """Entropy [B] of the policy distribution `policy_logprobs` (T == 0 rows at T = 1): how uncertain the policy is
  about its next token (tree rollouts branch where a turn's tokens were uncertain, `rollout.tree_harness`)."""
  return entropy(policy_logprobs(logits_BxV, temperature_B))


def sampling_logprobs(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                      top_p_B: jax.Array) -> jax.Array:
  """Log-probabilities [B, V] of the sampling distribution (-inf outside its support).

  Args:
    logits_BxV: raw logits.
    temperature_B: float; 0 means greedy.
    top_k_B: int; 0 means off.
    top_p_B: float in (0, 1]; 1 means off.
  """
  lp_BxV = policy_logprobs(logits_BxV, temperature_B)
  greedy_BxV = jnp.arange(logits_BxV.shape[1])[None, :] == jnp.argmax(logits_BxV, axis=-1)[:, None]
  # Sorting the vocabulary dominates a small decode step on CPU: skip it unless some row truncates.
  truncate = ((top_k_B > 0) | (top_p_B < 1)).any()
  keep_BxV = jax.lax.cond(truncate, _truncation_mask, lambda lp, k, p: jnp.ones_like(lp, bool), lp_BxV, top_k_B,
                          top_p_B)
  keep_BxV = jnp.where((temperature_B > 0)[:, None], keep_BxV, greedy_BxV)
  return jax.nn.log_softmax(jnp.where(keep_BxV, lp_BxV, -jnp.inf), axis=-1)


def _truncation_mask(lp_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """[B, V] bool: the tokens top-k and then top-p keep (ties at the cut are kept)."""
  V = lp_BxV.shape[1]
  sorted_BxV = -jnp.sort(-lp_BxV, axis=-1)  # descending
  k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
  kth_B = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=1)[:, 0]
  # top-p after top-k: a token stays if the mass of strictly more likely (kept) tokens is below top_p.
  rank_V = jnp.arange(V)[None, :]
  sorted_p_BxV = jnp.where(rank_V < k_B[:, None], jnp.exp(sorted_BxV), 0.0)
  mass_BxV = sorted_p_BxV / sorted_p_BxV.sum(-1, keepdims=True)
  before_BxV = jnp.cumsum(mass_BxV, axis=-1) - mass_BxV
  n_keep_B = jnp.maximum(((before_BxV < top_p_B[:, None]) & (rank_V < k_B[:, None])).sum(-1), 1)
  cut_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=1)[:, 0]
  return lp_BxV >= jnp.maximum(kth_B, cut_B)[:, None]


def draw(keys_B: jax.Array, logprobs_BxV: jax.Array) -> jax.Array:
  """One token per row from its (log-)distribution, with that row's key → int32 [B].

  Inverse-CDF sampling with one uniform per row (a Gumbel-max draw would generate V random numbers per row, which
  dominated a small CPU decode step). When every row's distribution is a point mass (greedy rows) the draw is
  its argmax, without the cumulative sum.
  """
  point_mass = (jnp.isfinite(logprobs_BxV).sum(-1) == 1).all()
  return jax.lax.cond(point_mass, lambda k, lp: jnp.argmax(lp, axis=-1).astype(jnp.int32), draw_inverse_cdf,
                      keys_B, logprobs_BxV)


def draw_inverse_cdf(keys_B: jax.Array, logprobs_BxV: jax.Array) -> jax.Array:
  """Token i with cdf[i-1] <= u * total < cdf[i] for u ~ U[0, 1) (unnormalised log-probabilities are fine)."""
  lp = logprobs_BxV.astype(jnp.float32)
  p_BxV = jnp.exp(lp - jnp.max(lp, axis=-1, keepdims=True))
  cdf_BxV = jnp.cumsum(p_BxV, axis=-1)
  u_B = jax.vmap(jax.random.uniform)(keys_B) * cdf_BxV[:, -1]
  idx_B = (cdf_BxV <= u_B[:, None]).sum(-1)
  # u * total may round up to the total: fall back to the last token with positive probability, never a zero one.
  V = lp.shape[1]
  last_B = V - 1 - jnp.argmax(p_BxV[:, ::-1] > 0, axis=-1)
  return jnp.minimum(idx_B, last_B).astype(jnp.int32)


def step_keys(base_keys_B: jax.Array, index_B: jax.Array, stream: int = 0) -> jax.Array:
  """Per-row keys for the token at output index `index_B`: fold_in(fold_in(row key, stream), index)."""
  return jax.vmap(lambda k, i: jax.random.fold_in(jax.random.fold_in(k, stream), i))(base_keys_B, index_B)


def sampling_probs_reference(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """Plain NumPy reference for one row: sort, cut at top-k, cut at top-p, renormalise."""
  logits_V = np.asarray(logits_V, np.float64)
  p = np.zeros_like(logits_V)
  if temperature == 0:
    p[np.argmax(logits_V)] = 1.0
    return p
  z = logits_V / temperature
  q = np.exp(z - z.max())
  q /= q.sum()
  order = np.argsort(-q, kind="stable")
  keep = order[:top_k] if top_k > 0 else order
  mass, kept = 0.0, []
  qk = q[keep] / q[keep].sum()
  for tok, m in zip(keep, qk):
    if mass >= top_p:
      break
    kept.append(tok)
    mass += m
  p[kept] = q[kept]
  return p / p.sum()
