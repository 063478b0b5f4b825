"""Targets and the MTP losses of language-model training; the vocabulary-wide parts run in `model.head` (chunked,
never holding [B, L, V] logits).

Shapes: B batch, L length, D hidden, V vocab, N number of MTP modules.

Batch contract (see composer_jax/train/data.py): `tokens`, `segment_ids` (0 = padding), `loss_mask` (1 where the
token is a training target). Position t predicts token t+1+k (k = 0 for the main head, k ≥ 1 for MTP module k-1)
only when t and t+1+k lie in the same non-padding segment and token t+1+k has loss_mask 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.model import head


def shifted_targets(tokens_BxL, segment_ids_BxL, loss_mask_BxL, shift: int):
  """Targets `tokens[t+shift]` and their validity mask, both [B, L] (the last `shift` positions are invalid)."""
  B, L = tokens_BxL.shape
  pad = lambda x: jnp.concatenate([x[:, shift:], jnp.zeros((B, shift), x.dtype)], axis=1)
  targets = pad(tokens_BxL)
  same_doc = (pad(segment_ids_BxL) == segment_ids_BxL) & (segment_ids_BxL > 0)
  mask = same_doc & (pad(loss_mask_BxL.astype(jnp.float32)) > 0)
  return targets, mask.astype(jnp.float32)


def mtp_losses(h_BxLxD, mtp_h_NxBxLxD, w_DxV, mtp_w_DxV, tokens_BxL, segment_ids_BxL, loss_mask_BxL, mode: str,
               *, chunk_size: int = head.DEFAULT_CHUNK):
  """Per-module MTP losses and top-1 agreement with the main head, each [N], through the chunked head.

  Args:
    h_BxLxD: the trunk's hidden after the final norm (`model.hidden_states`); the main head's input.
    mtp_h_NxBxLxD: the MTP modules' hiddens (`aux["mtp_hidden"]`).
    w_DxV: the LM head (`model.lm_head(params, cfg)`), for the main head's distribution (never differentiated here).
    mtp_w_DxV: the head the MTP hiddens go through (the same weight, detached when the trunk is).
    tokens_BxL, segment_ids_BxL, loss_mask_BxL: the batch.
    mode: 'self_distill' or 'cross_entropy'.

  MTP module k (0-based) at position t predicts token t+2+k. The main head predicts that same token at position
  t+1+k, so in `self_distill` mode the target is the main model's own stop-gradient distribution there (the
  report's recipe); in `cross_entropy` mode it is the data token. Agreement (argmax equality with the main head at
  the matching position) is the acceptance rate greedy speculative decoding with these heads would see.
  """
  if mode not in ("self_distill", "cross_entropy"):
    raise ValueError(f"Unknown MTP loss mode {mode!r}; valid: 'self_distill', 'cross_entropy'")
  n_mtp = mtp_h_NxBxLxD.shape[0]
  teacher_h = jax.lax.stop_gradient(h_BxLxD)
  losses, agreements = [], []
  for k in range(n_mtp):
    targets, mask = shifted_targets(tokens_BxL, segment_ids_BxL, loss_mask_BxL, k + 2)
    teacher_at = jnp.roll(teacher_h, -(k + 1), axis=1)   # the main head's input at t+1+k, aligned to position t
    student_h, student_w = mtp_h_NxBxLxD[k], mtp_w_DxV
    if mode == "cross_entropy":
      loss, _ = head.cross_entropy(student_h, student_w, targets, mask, chunk_size=chunk_size)
      student_h, student_w = jax.lax.stop_gradient(student_h), jax.lax.stop_gradient(student_w)   # metric only
    ce_BxL, agree_BxL = head.distill_cross_entropy(student_h, student_w, teacher_at, w_DxV, chunk_size=chunk_size)
    if mode == "self_distill":
      loss = masked_mean(ce_BxL, mask)
    losses.append(loss)
    agreements.append(masked_mean(agree_BxL, mask))
  return jnp.stack(losses) if losses else jnp.zeros((0,)), jnp.stack(agreements) if agreements else jnp.zeros((0,))


def masked_mean(x_BxL, mask_BxL):
  """The mean of `x` over the positions where `mask` is 1 (0 when there are none)."""
  return jnp.sum(x_BxL * mask_BxL) / jnp.maximum(jnp.sum(mask_BxL), 1.0)
