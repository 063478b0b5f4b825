"""MTP speculative decoding: MTP module 0 drafts one token, the trunk verifies it, exact rejection sampling.

Per step, with x_s the row's pending token (sampled, not yet fed) at slot s:
  1. module 0 runs on slots s-2, s-1 (trunk hiddens h_{s-2}, h_{s-1} with tokens x_{s-1}, x_s; slot s-2 is redone
     because the last step may have left it computed with a draft that was then rejected) → draft distribution q
     for x_{s+1}; draw d ~ q;
  2. the trunk runs on [x_s, d] at slots s, s+1 → target distributions p_{s+1}, p_{s+2};
  3. accept d with probability min(1, p(d) / q(d)) (Leviathan et al. 2023 / Chen et al. 2023); on acceptance draw
     a bonus x_{s+2} ~ p_{s+2}, else draw x_{s+1} from the residual max(0, p - q) (renormalised).
Each emitted token is then distributed exactly as under plain sampling with the same (temperature, top-k, top-p)
distribution; with temperature 0 both p and q are one-hot and the output equals greedy decoding token for token.

Letters: B rows, P padded prompt width, T output buffer length, V vocab, D hidden.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.model.config import ModelConfig
from composer_jax.sampling import cached_model as cm
from composer_jax.sampling import sampler
from composer_jax.sampling.decode import EXTRA, Batch, Output, _first_token, _out_buffers, is_stop, prefill

DRAFT, ACCEPT, RESIDUAL = 1, 2, 3  # key streams (stream 0 draws the regular tokens)


def _take(a_BxV: jax.Array, tok_B: jax.Array) -> jax.Array:
  return jnp.take_along_axis(a_BxV, tok_B[:, None], 1)[:, 0]


def accept_or_resample(key_acc_B, key_res_B, p_lp_BxV: jax.Array, q_lp_BxV: jax.Array, d_B: jax.Array):
  """Rejection step → (accepted bool [B], token [B]: d if accepted, else a draw from normalised max(0, p - q))."""
  ratio_B = jnp.exp(_take(p_lp_BxV, d_B) - _take(q_lp_BxV, d_B))
  u_B = jax.vmap(jax.random.uniform)(key_acc_B)
  accepted_B = u_B < ratio_B
  resid_BxV = jnp.maximum(jnp.exp(p_lp_BxV) - jnp.exp(q_lp_BxV), 0.0)
  # The residual is never all-zero after a rejection; the fallback to p only guards rounding.
  resid_BxV = jnp.where(resid_BxV.sum(-1, keepdims=True) > 0, resid_BxV, jnp.exp(p_lp_BxV))
  resampled_B = sampler.draw(key_res_B, jnp.log(resid_BxV))
  return accepted_B, jnp.where(accepted_B, d_B, resampled_B)


def generate_speculative(params: dict, batch: Batch, cfg: ModelConfig, max_len: int) -> Output:
  """Like `decode.generate`, drafting with MTP module 0 (needs cfg.num_nextn_predict_layers >= 1)."""
  if cfg.num_nextn_predict_layers < 1 or "mtp" not in params:
    raise ValueError("speculative decoding needs MTP modules (cfg.num_nextn_predict_layers >= 1)")
  U, P = batch.prompts_UxP.shape
  if P < 2:
    raise ValueError(f"speculative decoding needs a padded prompt width >= 2, got {P}")
  B, T = batch.row_prompt_B.shape[0], max_len
  keys_B = jax.vmap(jax.random.key)(batch.seeds_B)
  cache, logits_BxV, h_BxPxD, prompt_experts = prefill(params, batch, cfg, P + T + EXTRA, mtp=True)
  pad_B = batch.pad_U[batch.row_prompt_B]
  rows_prompt_BxP = batch.prompts_UxP[batch.row_prompt_B]
  tok_B, lp_B = _first_token(logits_BxV, batch, keys_B)
  toks, lps, routes = _out_buffers(B, T, cfg)
  toks, lps = toks.at[:, 0].set(tok_B), lps.at[:, 0].set(lp_B)
  dist = lambda lg: sampler.sampling_logprobs(lg, batch.temperature_B, batch.top_k_B, batch.top_p_B)  # noqa: E731
  policy = lambda lg: sampler.policy_logprobs(lg, batch.temperature_B)  # noqa: E731

  def cond(state):
    s_B, end_B = state[0], state[-1]
    return (s_B - P < end_B).any()

  def body(state):
    s_B, h2_Bx2xD, tok2_Bx2, cache, toks, lps, routes, drafted, accepted, steps, end_B = state
    active_B = s_B - P < end_B
    idx_B = s_B - P  # output index of the pending token x_s
    mtp_logits, cache = cm.mtp_cached(params, h2_Bx2xD, tok2_Bx2[None], cache, s_B - 2, pad_B, cfg)
    q_lp = dist(mtp_logits[0, :, 1])
    d_B = sampler.draw(sampler.step_keys(keys_B, idx_B + 1, DRAFT), q_lp)
    x_s = tok2_Bx2[:, 1]
    logits, h_Bx2xD, experts, cache = cm.forward_cached(params, jnp.stack([x_s, d_B], 1), cache, s_B, pad_B, cfg)
    acc_B, x1_B = accept_or_resample(sampler.step_keys(keys_B, idx_B + 1, ACCEPT),
                                     sampler.step_keys(keys_B, idx_B + 1, RESIDUAL), dist(logits[:, 0]), q_lp, d_B)
    x2_B = sampler.draw(sampler.step_keys(keys_B, idx_B + 2), dist(logits[:, 1]))
    lp1_B, lp2_B = _take(policy(logits[:, 0]), x1_B), _take(policy(logits[:, 1]), x2_B)
    keep = lambda new, old: jnp.where(active_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731

    def write(buf, new_Bx2, at_B):
      old = jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, 2, axis=0))(buf, at_B)
      return cm.write_rows(buf, keep(new_Bx2, old), at_B)

    toks = write(toks, jnp.stack([x1_B, x2_B], 1), idx_B + 1)
    lps = write(lps, jnp.stack([lp1_B, lp2_B], 1), idx_B + 1)
    routes = write(routes, jnp.transpose(experts, (1, 2, 0, 3)), idx_B)
    # Tokens fed this step: x_s always, d when accepted; a stop among them ends the row after it.
    end_B = jnp.where(active_B & is_stop(x_s, batch.stop_BxS) & (idx_B < end_B), idx_B + 1, end_B)
    end_B = jnp.where(active_B & acc_B & is_stop(d_B, batch.stop_BxS) & (idx_B + 1 < end_B), idx_B + 2, end_B)
    h_prev_BxD = h2_Bx2xD[:, 1]
    new_h2 = jnp.where(acc_B[:, None, None], h_Bx2xD, jnp.stack([h_prev_BxD, h_Bx2xD[:, 0]], 1))
    new_tok2 = jnp.where(acc_B[:, None], jnp.stack([d_B, x2_B], 1), jnp.stack([x_s, x1_B], 1))
    s_new = s_B + 1 + acc_B.astype(jnp.int32)
    n_act = active_B.sum()
    return (keep(s_new, s_B), keep(new_h2, h2_Bx2xD), keep(new_tok2, tok2_Bx2), cache, toks, lps, routes,
            drafted + n_act, accepted + (acc_B & active_B).sum(), steps + 1, end_B)

  z = jnp.zeros((), jnp.int32)
  tok2 = jnp.stack([rows_prompt_BxP[:, -1], tok_B], 1)
  state = (jnp.full((B,), P, jnp.int32), h_BxPxD[:, -2:], tok2, cache, toks, lps, routes, z, z, z,
           batch.max_tokens_B.astype(jnp.int32))
  state = jax.lax.while_loop(cond, body, state)
  _, _, _, _, toks, lps, routes, drafted, accepted, steps, end_B = state
  return Output(toks[:, :T], lps[:, :T], routes[:, :T], end_B, prompt_experts,
                {"steps": steps, "drafted": drafted, "accepted": accepted})
