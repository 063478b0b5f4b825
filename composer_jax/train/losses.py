"""Token losses for language-model training: next-token CE and the MTP losses.

Shapes: B batch, L length, V vocab, N number of MTP modules.

Batch contract (see composer_jax/train/data.py): `tokens`, `segment_ids` (0 = padding), `loss_mask` (1 where the
token is a training target). Position t predicts token t+1+k (k = 0 for the main head, k ≥ 1 for MTP module k-1)
only when t and t+1+k lie in the same non-padding segment and token t+1+k has loss_mask 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def shifted_targets(tokens_BxL, segment_ids_BxL, loss_mask_BxL, shift: int):
  """Targets `tokens[t+shift]` and their validity mask, both [B, L] (the last `shift` positions are invalid)."""
  B, L = tokens_BxL.shape
  pad = lambda x: jnp.concatenate([x[:, shift:], jnp.zeros((B, shift), x.dtype)], axis=1)
  targets = pad(tokens_BxL)
  same_doc = (pad(segment_ids_BxL) == segment_ids_BxL) & (segment_ids_BxL > 0)
  mask = same_doc & (pad(loss_mask_BxL.astype(jnp.float32)) > 0)
  return targets, mask.astype(jnp.float32)


def cross_entropy(logits_BxLxV, targets_BxL, mask_BxL):
  """Masked mean token cross-entropy and the number of counted tokens."""
  logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1)[..., 0]
  n = jnp.sum(mask_BxL)
  return jnp.sum(nll * mask_BxL) / jnp.maximum(n, 1.0), n


def soft_cross_entropy(logits_BxLxV, target_probs_BxLxV, mask_BxL):
  """Masked mean of −Σ p·log q: cross-entropy to a soft target (equals KL(p‖q) + H(p); same gradient)."""
  logq = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  ce = -jnp.sum(target_probs_BxLxV * logq, axis=-1)
  return jnp.sum(ce * mask_BxL) / jnp.maximum(jnp.sum(mask_BxL), 1.0)


def mtp_losses(main_logits_BxLxV, mtp_logits_NxBxLxV, tokens_BxL, segment_ids_BxL, loss_mask_BxL, mode: str):
  """Per-module MTP losses and top-1 agreement with the main head, each [N].

  MTP module k (0-based) at position t predicts token t+2+k. The main head predicts that same token at position
  t+1+k, so in `self_distill` mode the target is the main model's own stop-gradient distribution there (the
  report's recipe); in `cross_entropy` mode it is the data token. Agreement (argmax equality with the main head at
  the matching position) is the acceptance rate greedy speculative decoding with these heads would see.
  """
  n_mtp = mtp_logits_NxBxLxV.shape[0]
  main_logits = jax.lax.stop_gradient(main_logits_BxLxV.astype(jnp.float32))
  losses, agreements = [], []
  for k in range(n_mtp):
    shift = k + 2
    targets, mask = shifted_targets(tokens_BxL, segment_ids_BxL, loss_mask_BxL, shift)
    # Main-head logits at position t+1+k, aligned to position t.
    main_at = jnp.roll(main_logits, -(k + 1), axis=1)
    logits_k = mtp_logits_NxBxLxV[k]
    if mode == "self_distill":
      loss = soft_cross_entropy(logits_k, jax.nn.softmax(main_at, axis=-1), mask)
    elif mode == "cross_entropy":
      loss, _ = cross_entropy(logits_k, targets, mask)
    else:
      raise ValueError(f"Unknown MTP loss mode {mode!r}")
    agree = (jnp.argmax(logits_k, -1) == jnp.argmax(main_at, -1)).astype(jnp.float32)
    losses.append(loss)
    agreements.append(jnp.sum(agree * mask) / jnp.maximum(jnp.sum(mask), 1.0))
  return jnp.stack(losses) if losses else jnp.zeros((0,)), jnp.stack(agreements) if agreements else jnp.zeros((0,))
