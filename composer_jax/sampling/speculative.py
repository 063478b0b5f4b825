"""MTP speculative decoding: MTP module 0 drafts k tokens (chained on its own output), the trunk verifies them in
one call, exact rejection sampling.

Per step, with x_s the row's pending token (sampled, not yet fed) at slot s:
  1. module 0 runs on the k+1 slots s-k-1 .. s-1 (trunk hiddens with the next tokens; slots already computed by
     the last step are redone, which keeps the shapes fixed and overwrites entries computed from drafts) → draft
     distribution q_0 for x_{s+1}; draw d_0 ~ q_0. Then module 0 chains on its own output hidden at slot s-1+j with
     token d_{j-1} → q_j, d_j for j = 1..k-1 (DeepSeek-V3 / SGLang NextN style);
  2. the trunk runs on [x_s, d_0 .. d_{k-1}] at slots s .. s+k → target distributions p_0 .. p_k;
  3. d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) while all before it were (Leviathan et al. 2023 /
     Chen et al. 2023); with n accepted, one more token is drawn from the residual max(0, p_n - q_n) (renormalised)
     if n < k, else from p_k (the bonus token). The two cases exclude each other, so they share one uniform.
Each emitted token is then distributed exactly as under plain sampling with the same (temperature, top-k, top-p)
distribution; with temperature 0 p and q are one-hot and the output equals greedy decoding token for token (a
batch of only greedy rows runs a loop specialised to argmax comparisons).

Letters: B rows, P padded prompt width, Lo output buffer length (new tokens a row can hold), V vocab, D hidden,
k drafts per step, W = k + 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.model.config import ModelConfig
from composer_jax.sampling import cached_model as cm
from composer_jax.sampling import sampler
from composer_jax.sampling.decode import Batch, Output, _first_token, _out_buffers, greedy_or_sampled, is_stop

DRAFT, ACCEPT, FINAL = 1, 2, 3  # key streams (stream 0 draws plain tokens; FINAL the residual-or-bonus token)


def accept_or_resample(key_acc_B, key_res_B, p_lp_BxV: jax.Array, q_lp_BxV: jax.Array, d_B: jax.Array):
  """One-draft rejection step → (accepted bool [B], token [B]: d if accepted, else a draw from norm. max(0, p - q))."""
  acc_Bx1, n_B, y_B = verify(key_acc_B[:, None], key_res_B, p_lp_BxV[:, None], q_lp_BxV[:, None], d_B[:, None],
                             bonus=False)
  return acc_Bx1[:, 0], jnp.where(n_B > 0, d_B, y_B)


def verify(keys_acc_Bxk, key_final_B, p_lp_BxWxV: jax.Array, q_lp_BxkxV: jax.Array, d_Bxk: jax.Array,
           bonus: bool = True):
  """Rejection sampling of k drafts → (accepted [B, k], n accepted in a row [B], the final token y [B]).

  p_lp has k + 1 target distributions when `bonus` (y ~ p_k if all k are accepted), else k (y is then only
  meaningful where n < k). y is drawn from normalised max(0, p_n - q_n) when n < k.
  """
  B, k = d_Bxk.shape
  ratio_Bxk = jnp.exp(jnp.take_along_axis(p_lp_BxWxV[:, :k], d_Bxk[..., None], 2)[..., 0]
                      - jnp.take_along_axis(q_lp_BxkxV, d_Bxk[..., None], 2)[..., 0])
  u_Bxk = jax.vmap(jax.vmap(jax.random.uniform))(keys_acc_Bxk)
  acc_Bxk = u_Bxk < ratio_Bxk
  n_B = jnp.cumprod(acc_Bxk, axis=1).sum(1).astype(jnp.int32)
  at_B = jnp.minimum(n_B, k - 1)
  p_n_BxV = jnp.exp(jnp.take_along_axis(p_lp_BxWxV, at_B[:, None, None], 1)[:, 0])
  q_n_BxV = jnp.exp(jnp.take_along_axis(q_lp_BxkxV, at_B[:, None, None], 1)[:, 0])
  resid_BxV = jnp.maximum(p_n_BxV - q_n_BxV, 0.0)
  # The residual is never all-zero after a rejection; the fallback to p only guards rounding.
  resid_BxV = jnp.where(resid_BxV.sum(-1, keepdims=True) > 0, resid_BxV, p_n_BxV)
  if bonus:
    resid_BxV = jnp.where((n_B == k)[:, None], jnp.exp(p_lp_BxWxV[:, k]), resid_BxV)
  return acc_Bxk, n_B, sampler.draw_inverse_cdf(key_final_B, jnp.log(resid_BxV))


def _verify_greedy(p_logits_BxWxV: jax.Array, d_Bxk: jax.Array):
  """`verify` when every row is greedy: argmax comparisons only."""
  k = d_Bxk.shape[1]
  best_BxW = jnp.argmax(p_logits_BxWxV, axis=-1).astype(jnp.int32)
  acc_Bxk = best_BxW[:, :k] == d_Bxk
  n_B = jnp.cumprod(acc_Bxk, axis=1).sum(1).astype(jnp.int32)
  return acc_Bxk, n_B, jnp.take_along_axis(best_BxW, n_B[:, None], 1)[:, 0]


def _shift_window(old_BxWx_: jax.Array, new_BxWx_: jax.Array, n_B: jax.Array) -> jax.Array:
  """The W entries starting at n + 1 of old ++ new (the window that ends at the new pointer)."""
  both = jnp.concatenate([old_BxWx_, new_BxWx_], axis=1)
  W = old_BxWx_.shape[1]
  return jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, W, axis=0))(both, n_B + 1)


def _check(params: dict, cfg: ModelConfig, k: int, P: int) -> None:
  if cfg.num_nextn_predict_layers < 1 or "mtp" not in params:
    raise ValueError("speculative decoding needs MTP modules (cfg.num_nextn_predict_layers >= 1)")
  if k < 1:
    raise ValueError(f"draft_tokens must be >= 1, got {k}")
  if P < k + 1:
    raise ValueError(f"speculative decoding with {k} drafts needs a padded prompt width >= {k + 1}, got {P}")


def _draft(params, cache, h_BxWxD, tok_BxW, s_B, pad_B, cfg: ModelConfig, k: int, draw):
  """Step 1: module 0 over the window, then chained on its own output → (drafts [B, k], their draft
  distributions (a list of k [B, V] log-probs; empty when `draw` is None, i.e. greedy), cache)."""
  W = k + 1
  g, cache = cm.mtp_module(params, 0, h_BxWxD, tok_BxW, cache, s_B - W, pad_B, cfg)
  drafts, q_lps = [], []
  for j in range(k):
    if j > 0:
      g, cache = cm.mtp_module(params, 0, g[:, -1:], drafts[-1][:, None], cache, s_B - 1 + j, pad_B, cfg)
    logits_BxV = cm.mtp_logits(params, 0, g[:, -1], cfg)
    if draw is None:
      drafts.append(jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32))
    else:
      d_B, q_lp_BxV = draw(logits_BxV, j)
      drafts.append(d_B)
      q_lps.append(q_lp_BxV)
  return jnp.stack(drafts, 1), q_lps, cache


def _write_window(buf_BxLox_, new_BxWx_, at_B, active_B):
  """Writes each active row's W new entries at at_B (inactive rows keep theirs)."""
  W = new_BxWx_.shape[1]
  old = jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, W, axis=0))(buf_BxLox_, at_B)
  keep = jnp.where(active_B.reshape((-1,) + (1,) * (new_BxWx_.ndim - 1)), new_BxWx_, old)
  return cm.write_rows(buf_BxLox_, keep, at_B)


def _end_at_stops(end_B, fed_BxW, n_B, idx_B, active_B, stop_BxZ):
  """Tokens fed this step are x_s and the n accepted drafts; the first stop among them ends the row after it."""
  for j in range(fed_BxW.shape[1]):
    stop_B = active_B & (j <= n_B) & is_stop(fed_BxW[:, j], stop_BxZ) & (idx_B + j < end_B)
    end_B = jnp.where(stop_B, idx_B + j + 1, end_B)
  return end_B


def slack(draft_tokens: int) -> int:
  """Cache and output-buffer slots past P + Lo a speculative step may write: W tokens past a row's pointer, which
  is < Lo while the row is active."""
  return draft_tokens + 2


def decode_speculative(params: dict, batch: Batch, cfg: ModelConfig, max_len: int, draft_tokens: int, cache: dict,
                       logits_BxV: jax.Array, h_BxHxD: jax.Array) -> Output:
  """Like `decode.decode`, drafting `draft_tokens` tokens per step with MTP module 0 (needs MTP modules), after a
  `prefill` with `mtp=True` into >= P + max_len + slack(draft_tokens) slots; `h_BxHxD` holds the trunk hiddens of
  the last H >= draft_tokens + 1 prompt slots (the first step's module-0 window reads the last draft_tokens + 1), so
  one prefill serves every k up to H - 1."""
  k, W = draft_tokens, draft_tokens + 1
  _, P = batch.prompts_UxP.shape
  _check(params, cfg, k, P)
  if h_BxHxD.shape[1] < W:
    raise ValueError(f"the prefill kept the hiddens of {h_BxHxD.shape[1]} slots, fewer than draft_tokens + 1 = {W}")
  B, Lo = batch.row_prompt_B.shape[0], max_len
  extra = slack(k)
  keys_B = jax.vmap(jax.random.key)(batch.seeds_B)
  pad_B = batch.pad_U[batch.row_prompt_B]
  params, cache = cm.split_layers(params), cm.split_layers(cache)
  tok_B, lp_B = _first_token(logits_BxV, batch, keys_B)
  toks, lps, routes = _out_buffers(B, Lo, cfg, extra)
  toks, lps = toks.at[:, 0].set(tok_B), lps.at[:, 0].set(lp_B)
  repeat = lambda a_B, n: jnp.repeat(a_B, n, axis=0)  # noqa: E731  per-row settings for [B * n, V] rows

  def dist(lg_BxNxV):
    n = lg_BxNxV.shape[1]
    lp = sampler.sampling_logprobs(lg_BxNxV.reshape(B * n, -1), repeat(batch.temperature_B, n),
                                   repeat(batch.top_k_B, n), repeat(batch.top_p_B, n))
    return lp.reshape(B, n, -1)

  def cond(state):
    s_B, end_B = state[0], state[-1]
    return (s_B - P < end_B).any()

  def body(greedy: bool, state):
    s_B, h_BxWxD, tok_BxW, cache, toks, lps, routes, hist, steps, end_B = state
    active_B = s_B - P < end_B
    idx_B = s_B - P  # output index of the pending token x_s

    def draw(logits_BxV, j):
      q_lp_BxV = dist(logits_BxV[:, None])[:, 0]
      return sampler.draw_inverse_cdf(sampler.step_keys(keys_B, idx_B + 1 + j, DRAFT), q_lp_BxV), q_lp_BxV

    d_Bxk, q_lps, cache = _draft(params, cache, h_BxWxD, tok_BxW, s_B, pad_B, cfg, k, None if greedy else draw)
    # 2. Verify: the trunk on [x_s, d_0 .. d_{k-1}].
    fed_BxW = jnp.concatenate([tok_BxW[:, -1:], d_Bxk], axis=1)
    logits_BxWxV, hv_BxWxD, experts, cache = cm.forward_cached(params, fed_BxW, cache, s_B, pad_B, cfg)
    # 3. Accept / resample.
    if greedy:
      _, n_B, y_B = _verify_greedy(logits_BxWxV, d_Bxk)
    else:
      keys_acc = jax.vmap(lambda i: sampler.step_keys(keys_B, idx_B + 1 + i, ACCEPT), out_axes=1)(jnp.arange(k))
      _, n_B, y_B = verify(keys_acc, sampler.step_keys(keys_B, idx_B + 1, FINAL), dist(logits_BxWxV),
                           jnp.stack(q_lps, 1), d_Bxk)
    out_BxW = jnp.where(jnp.arange(W)[None, :] < n_B[:, None], jnp.concatenate([d_Bxk, y_B[:, None]], 1),
                        y_B[:, None])
    policy_BxWxV = sampler.policy_logprobs(logits_BxWxV.reshape(B * W, -1), repeat(batch.temperature_B, W))
    lp_BxW = jnp.take_along_axis(policy_BxWxV.reshape(B, W, -1), out_BxW[..., None], 2)[..., 0]
    toks = _write_window(toks, out_BxW, idx_B + 1, active_B)
    lps = _write_window(lps, lp_BxW, idx_B + 1, active_B)
    routes = _write_window(routes, jnp.transpose(experts, (1, 2, 0, 3)), idx_B, active_B)
    end_B = _end_at_stops(end_B, fed_BxW, n_B, idx_B, active_B, batch.stop_BxZ)
    keep = lambda new, old: jnp.where(active_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    return (keep(s_B + 1 + n_B, s_B), keep(_shift_window(h_BxWxD, hv_BxWxD, n_B), h_BxWxD),
            keep(_shift_window(tok_BxW, out_BxW, n_B), tok_BxW), cache, toks, lps, routes,
            hist.at[n_B].add(active_B.astype(jnp.int32)), steps + 1, end_B)

  z = jnp.zeros((), jnp.int32)
  tok_BxW = jnp.concatenate([batch.prompts_UxP[batch.row_prompt_B][:, P - k:], tok_B[:, None]], 1)
  state = (jnp.full((B,), P, jnp.int32), h_BxHxD[:, -W:], tok_BxW, cache, toks, lps, routes,
           jnp.zeros((k + 1,), jnp.int32), z, batch.max_tokens_B.astype(jnp.int32))
  state = greedy_or_sampled(batch, cond, body, state)
  _, _, _, cache, toks, lps, routes, hist, steps, end_B = state
  # hist[n]: row-steps that accepted n drafts in a row (its sum: the rows' trunk forwards).
  stats = {"steps": steps, "drafted": k * hist.sum(), "accepted": (jnp.arange(k + 1) * hist).sum(),
           "accept_hist": hist}
  return Output(toks[:, :Lo], lps[:, :Lo], routes[:, :Lo], end_B, None, stats, cache)
