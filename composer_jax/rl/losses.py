"""Policy-gradient RL losses: group advantages, truncated importance weights, k1 KL to a reference policy.

Letters: B rows, L length, D hidden, V vocab, S sequences (one sequence = one context segment of a trajectory; a
row holds one, or several when packed: `rl.batch`).

Per generated token t of a sequence i (mask m_t = 1 only on model-generated tokens):

  ρ_t   = π_θ(y_t) / μ(y_t)                 μ = the inference engine's recorded logprob (rollout policy)
  w_t   = sg(min(ρ_t, c_i))                  truncated importance weight (c_i = `is_cap_B[i]`; Yao et al. 2025 "TIS")
  k1_t  = log π_θ(y_t) − log π_ref(y_t)      the k1 estimator of KL(π_θ ‖ π_ref) (= −log r, r = π_ref/π_θ)
  A_t   = A_i − β · sg(k1_t)                 the KL enters as a per-token penalty on the advantage
  ℓ_t   = −w_t · A_t · exp(log π_θ − sg(log π_θ))     value −w_t·A_t, gradient −w_t·A_t·∇log π_θ(y_t)

Why the KL is a reward penalty: k1 used directly as a loss term has gradient ∇log π_θ, whose expectation under the
sampling policy is zero — it would only add noise. As a stop-gradient penalty on the advantage it yields
β·E[(log π_θ − log π_ref)·∇log π_θ], the exact gradient of the per-token KL at each context, while its value is
still the unbiased k1 estimate that is logged as `kl` (the report's choice of k1 over k3, whose variance blows up
when the policies drift apart). Tokens were sampled by μ, not π_θ, hence the same weight w_t on the KL part.

Advantage A_i = reward − mean of the rewards of the trajectories in its group (optionally divided by their
standard deviation, ddof = 0, + eps). Each trajectory counts once even when it spans several rows (segments of a
self-summarization chain): all its rows carry the final reward and the same advantage.

Tree groups (`rollout.tree`, `rl.batch`): A_t is per token (its node's advantage) and each token carries a loss
weight n_t, the number of leaves that share it; a shared token is in the loss once, ℓ_t · n_t, which equals the loss
of the leaves unrolled into flat rows (each shared token repeated n_t times). The 'tokens' denominator is then
Σ n_t (the unrolled token count). The logged statistics (kl, importance ratios, clip fraction, gap, generated
tokens) count each token once.

Normalisation (`LossConfig.normalize`):
  'tokens'    Σ_t ℓ_t / (number of generated tokens in the batch) — the default. Every generated token has the
              same weight, so a long trajectory's tokens are not down-weighted (per-sequence means favour
              short answers when A > 0 and long ones when A < 0; DAPO, Dr. GRPO). The denominator varies from
              batch to batch, which rescales the step a little.
  'sequence'  mean over tokens of each sequence, then mean over sequences with generated tokens (original GRPO).
  'constant'  Σ_t ℓ_t / `norm_constant` (default B·L, fixed by the batch shape): an unbiased token sum with a
              constant scale (Dr. GRPO).

The MTP drafter (`mtp_self_distill`): MTP module k at position t predicts token t+2+k; its target is the policy's
own next-token distribution at position t+1+k (stop-gradient), on positions whose predicted token the policy
generated (the only tokens a speculative engine drafts). Beside the loss it reports how well the drafter would do
as a speculative-decoding draft at the rollouts' temperature T: top-1 agreement (the greedy acceptance rate) and the
expected acceptance Σ_v min(p_v, q_v) of one draft (p the policy's, q the drafter's distribution at T: the chance
that a draft q proposes is accepted by exact rejection sampling against p).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from composer_jax.model import head
from composer_jax.train import losses as lm_losses
from composer_jax.train.losses import masked_mean

NORMALIZATIONS = ("tokens", "sequence", "constant")
IMPORTANCE = ("truncate", "none")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Policy-gradient loss options (see the module docstring)."""
  kl_coef: float = 1e-3             # β
  is_cap: float = 2.0               # c: default truncation of ρ (the batch carries the per-row value)
  importance: str = "truncate"      # 'none': w = 1 (treat every token as on-policy; an ablation)
  normalize: str = "tokens"
  norm_constant: float | None = None
  adv_std: bool = False             # divide advantages by the group's reward std
  adv_eps: float = 1e-6

  def __post_init__(self):
    if self.normalize not in NORMALIZATIONS:
      raise ValueError(f"Unknown normalize {self.normalize!r}; valid: {NORMALIZATIONS}")
    if self.importance not in IMPORTANCE:
      raise ValueError(f"Unknown importance {self.importance!r}; valid: {IMPORTANCE}")
    if self.is_cap <= 0 or self.kl_coef < 0:
      raise ValueError(f"need is_cap > 0 and kl_coef >= 0, got {self.is_cap=} {self.kl_coef=}")


def token_logprobs(h_BxLxD: jax.Array, w_DxV: jax.Array, tokens_BxL: jax.Array, *, with_entropy: bool = False,
                   prev_BxL: jax.Array | None = None):
  """log p(token_t | tokens_<t) aligned to token positions, [B, L]; position 0 (no context) is 0.

  Through the chunked head (`model.head.token_logprobs`, no [B, L, V] logits): `h_BxLxD` is the hidden after the
  final norm (`model.hidden_states`), `w_DxV` the head (`model.lm_head`). With `with_entropy` also the entropy of
  the distribution each token was drawn from, aligned the same way: (logp_BxL, entropy_BxL).

  `prev_BxL`: the row position of each token's predecessor in its own stream (rows holding a tree's branches after
  their shared prefix, `rl.batch`: a branch's first token follows the prefix's last, not the row's previous token);
  a token that has none points at itself (a meaningless value, never trained). None: position t − 1.
  """
  if prev_BxL is not None:
    h_prev_BxLxD = jnp.take_along_axis(h_BxLxD, prev_BxL[..., None], axis=1)
    return head.token_logprobs(h_prev_BxLxD, w_DxV, tokens_BxL, with_entropy=with_entropy)
  # The head runs on all L positions (the last one's target is a pad and its output dropped): on L - 1 positions,
  # which the context axis does not divide, the per-device head ran every position on every context rank.
  out = head.token_logprobs(h_BxLxD, w_DxV, jnp.pad(tokens_BxL[:, 1:], ((0, 0), (0, 1))), with_entropy=with_entropy)
  align = lambda x_BxL: jnp.pad(x_BxL[:, :-1], ((0, 0), (1, 0)))
  return tuple(map(align, out)) if with_entropy else align(out)


def group_advantages(reward_B: jax.Array, group_B: jax.Array, first_B: jax.Array, valid_B: jax.Array, *,
                     scale_by_std: bool = False, eps: float = 1e-6) -> jax.Array:
  """Reward minus its group's mean over trajectories, per row; 0 on padding rows.

  Args:
    reward_B: each row's trajectory reward.
    group_B: int group index in [0, B) (batch-local).
    first_B: 1 on exactly one row of each trajectory (so multi-segment trajectories count once).
    valid_B: 1 on real rows, 0 on padding.
    scale_by_std: also divide by the group's reward std (ddof 0) + eps.
  """
  B = reward_B.shape[0]
  w_B = (first_B * valid_B).astype(jnp.float32)
  r_B = reward_B.astype(jnp.float32)
  n_G = jax.ops.segment_sum(w_B, group_B, num_segments=B)
  mean_G = jax.ops.segment_sum(w_B * r_B, group_B, num_segments=B) / jnp.maximum(n_G, 1.0)
  adv_B = r_B - mean_G[group_B]
  if scale_by_std:
    var_G = jax.ops.segment_sum(w_B * adv_B**2, group_B, num_segments=B) / jnp.maximum(n_G, 1.0)
    adv_B = adv_B / (jnp.sqrt(var_G)[group_B] + eps)
  return adv_B * valid_B.astype(jnp.float32)


def policy_loss(logp_BxL: jax.Array, inf_logp_BxL: jax.Array, ref_logp_BxL: jax.Array, adv: jax.Array,
                mask_BxL: jax.Array, is_cap: jax.Array, cfg: LossConfig, seq_BxL: jax.Array | None = None,
                num_seqs: int | None = None, weight_BxL: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """The token-level policy-gradient loss and its statistics.

  Args:
    logp_BxL: log π_θ of each token (differentiated).
    inf_logp_BxL: the rollout engine's logprobs μ (constants).
    ref_logp_BxL: the frozen reference policy's logprobs (constants).
    adv: advantage (constants), per row [B] or per token [B, L].
    mask_BxL: 1 on model-generated tokens to train on.
    is_cap: truncation c of the importance ratio, per row [B] or per token [B, L].
    cfg: loss options.
    seq_BxL, num_seqs: the sequence of each token, in [0, num_seqs), for 'sequence' normalisation of packed rows
      (None: each row is one sequence).
    weight_BxL: loss weight of each token (tree groups: the leaves that share it); None: 1 for every token.
  Returns:
    (loss, metrics): kl (mean k1), importance-ratio mean/min/max, clip_fraction (tokens with ρ > c),
    logprob_gap (mean |log π_θ − log μ|), generated_tokens.
  """
  B, L = logp_BxL.shape
  m = mask_BxL.astype(jnp.float32)
  inf_logp, ref_logp = jax.lax.stop_gradient(inf_logp_BxL), jax.lax.stop_gradient(ref_logp_BxL)
  per_token = lambda x: jnp.broadcast_to(x[:, None] if x.ndim == 1 else x, (B, L)).astype(jnp.float32)  # noqa: E731
  adv_BxL = jax.lax.stop_gradient(per_token(adv))
  lp_sg = jax.lax.stop_gradient(logp_BxL)
  log_ratio = lp_sg - inf_logp
  ratio = jnp.exp(log_ratio)
  cap = per_token(is_cap)
  w = jnp.minimum(ratio, cap) if cfg.importance == "truncate" else jnp.ones_like(ratio)
  k1 = lp_sg - ref_logp
  a_tok = adv_BxL - cfg.kl_coef * k1
  per_tok = -w * a_tok * jnp.exp(logp_BxL - lp_sg)
  n_tok = jnp.sum(m)
  lw = m if weight_BxL is None else m * jax.lax.stop_gradient(weight_BxL).astype(jnp.float32)
  if cfg.normalize == "tokens":
    loss = jnp.sum(per_tok * lw) / jnp.maximum(n_tok if weight_BxL is None else jnp.sum(lw), 1.0)
  elif cfg.normalize == "sequence":
    if weight_BxL is not None:
      raise ValueError("normalize='sequence' (a mean per sequence) is not defined for tree groups, whose shared "
                       "tokens belong to several leaves' sequences; use 'tokens' or 'constant'")
    if seq_BxL is None:
      seq_BxL, num_seqs = jnp.broadcast_to(jnp.arange(B)[:, None], (B, L)), B
    n_S = jax.ops.segment_sum(m.ravel(), seq_BxL.ravel(), num_segments=num_seqs)
    sums_S = jax.ops.segment_sum((per_tok * m).ravel(), seq_BxL.ravel(), num_segments=num_seqs)
    loss = jnp.sum(sums_S / jnp.maximum(n_S, 1.0)) / jnp.maximum(jnp.sum(n_S > 0), 1)
  else:
    loss = jnp.sum(per_tok * lw) / (cfg.norm_constant if cfg.norm_constant is not None else B * L)
  big = jnp.finfo(jnp.float32).max
  metrics = {"kl": masked_mean(k1, m), "importance_ratio_mean": masked_mean(ratio, m),
             "importance_ratio_max": jnp.max(jnp.where(m > 0, ratio, -big)),
             "importance_ratio_min": jnp.min(jnp.where(m > 0, ratio, big)),
             "clip_fraction": masked_mean((ratio > cap).astype(jnp.float32), m),
             "logprob_gap": masked_mean(jnp.abs(log_ratio), m), "generated_tokens": n_tok}
  return loss, metrics


def draft_acceptance(student_h_BxLxD: jax.Array, student_w_DxV: jax.Array, teacher_h_BxLxD: jax.Array,
                     teacher_w_DxV: jax.Array, temperature: float = 1.0, *,
                     chunk_size: int = head.DEFAULT_CHUNK) -> jax.Array:
  """Σ_v min(p_v, q_v) per token [B, L], p = softmax(teacher_h·teacher_w / T), q = softmax(student_h·student_w / T).

  The probability that one draft from q is accepted by rejection sampling against p (Leviathan et al. 2023). A
  metric: no gradient. Chunked over tokens like `model.head` (one [chunk, V] block at a time).
  """
  B, L, D = student_h_BxLxD.shape
  T = B * L
  Tc = min(chunk_size, T)
  n = -(-T // Tc)
  chunks = lambda x: jnp.pad(x.reshape(T, D), ((0, n * Tc - T), (0, 0))).reshape(n, Tc, D)
  sw, tw = (jax.lax.stop_gradient(w).astype(jnp.float32) / temperature for w in (student_w_DxV, teacher_w_DxV))

  def one(args):
    h_TcxD, th_TcxD = args
    q = jax.nn.softmax(jnp.dot(h_TcxD.astype(jnp.float32), sw), axis=-1)
    p = jax.nn.softmax(jnp.dot(th_TcxD.astype(jnp.float32), tw), axis=-1)
    return jnp.sum(jnp.minimum(p, q), axis=-1)
  hs = jax.lax.stop_gradient((chunks(student_h_BxLxD), chunks(teacher_h_BxLxD)))
  return jax.lax.map(one, hs).reshape(-1)[:T].reshape(B, L)


def draft_acceptance_reference(student_h_BxLxD, student_w_DxV, teacher_h_BxLxD, teacher_w_DxV, temperature=1.0):
  """The plain formula on full logits (what `draft_acceptance` computes)."""
  q = jax.nn.softmax(head.logits(student_h_BxLxD, student_w_DxV) / temperature, axis=-1)
  p = jax.nn.softmax(head.logits(teacher_h_BxLxD, teacher_w_DxV) / temperature, axis=-1)
  return jnp.sum(jnp.minimum(p, q), axis=-1)


def mtp_self_distill(h_BxLxD: jax.Array, mtp_h_NxBxLxD: jax.Array, w_DxV: jax.Array, mtp_w_DxV: jax.Array,
                     tokens_BxL: jax.Array, segment_ids_BxL: jax.Array, gen_mask_BxL: jax.Array,
                     temperature: float = 1.0) -> tuple[jax.Array, dict]:
  """The MTP modules' self-distillation loss on rollout rows and the drafter's agreement with the policy.

  Args:
    h_BxLxD: the policy trunk's hidden after the final norm (the teacher; never differentiated here).
    mtp_h_NxBxLxD: the MTP modules' hiddens (`aux["mtp_hidden"]`).
    w_DxV: the LM head; mtp_w_DxV: the head the MTP hiddens go through (detached unless the MTP loss trains the
      trunk and the head too).
    tokens_BxL, segment_ids_BxL: the batch; gen_mask_BxL: 1 on generated tokens (the targets counted).
    temperature: the rollouts' sampling temperature (the acceptance metric's; the loss distils at T = 1).

  Returns:
    (mean over modules of each module's masked mean −Σ p log q, metrics): mtp_loss, and for module 0 (the
    engine's drafter) mtp_agreement (top-1) and mtp_acceptance (expected Σ min(p, q) at T), masked means.
  """
  loss_N, agree_N = lm_losses.mtp_losses(h_BxLxD, mtp_h_NxBxLxD, w_DxV, mtp_w_DxV, tokens_BxL, segment_ids_BxL,
                                         gen_mask_BxL, "self_distill")
  _, mask = lm_losses.shifted_targets(tokens_BxL, segment_ids_BxL, gen_mask_BxL, 2)
  teacher_h = jnp.roll(h_BxLxD, -1, axis=1)   # the policy's input at t+1, aligned to module 0's position t
  acc_BxL = draft_acceptance(mtp_h_NxBxLxD[0], mtp_w_DxV, teacher_h, w_DxV, temperature)
  loss = jnp.mean(loss_N)
  return loss, {"mtp_loss": loss, "mtp_agreement": agree_N[0], "mtp_acceptance": masked_mean(acc_BxL, mask)}
