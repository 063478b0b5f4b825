"""MTP speculative decoding keeps the sampling distribution: the k-draft rejection step on fixed distributions,
greedy equality with plain decoding, and (slow) the second / third output tokens (verified first draft / first
chained draft) against their exact marginals computed from the trainer's forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.sampling import sampler
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from composer_jax.sampling.speculative import verify
from rollout.engines.protocol import GenerateRequest, SamplingParams

CFG = model.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, num_nextn_predict_layers=1)
PROMPT = (3, 1, 4, 1, 5)


def _close(freq, want, n):
  # 4.5 binomial standard deviations per token (false-alarm probability < 1e-4 over the vocabulary).
  np.testing.assert_array_less(np.abs(freq - want), 4.5 * np.sqrt(want * (1 - want) / n) + 1e-9)


def test_verify_k_drafts_emits_target_distributions():
  """Fixed (context-free) p_0..p_k and q_0..q_{k-1}: emitted token j is distributed as p_j, acceptance as theory."""
  V, k, n = 5, 2, 40000
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(V), size=k + 1)
  q = rng.dirichlet(np.ones(V), size=k)
  tile = lambda a: jnp.log(jnp.tile(jnp.asarray(a, jnp.float32)[None], (n, 1, 1)))  # noqa: E731
  keys = jax.random.split(jax.random.key(1), (n, 2 * k + 1))  # drafts, acceptance tests, final token
  d = jnp.stack([sampler.draw(keys[:, j], tile(q)[:, j]) for j in range(k)], 1)
  _, n_acc, y = jax.jit(verify)(keys[:, k:2 * k], keys[:, 2 * k], tile(p), tile(q), d)
  n_acc, y, d = np.asarray(n_acc), np.asarray(y), np.asarray(d)
  emitted = np.where(np.arange(k + 1)[None] < n_acc[:, None], np.concatenate([d, y[:, None]], 1), y[:, None])
  for j in range(k + 1):  # token j is emitted when the j drafts before it were accepted
    rows = n_acc >= j
    _close(np.bincount(emitted[rows, j], minlength=V) / rows.sum(), p[j], rows.sum())
  overlap = np.minimum(p[:k], q).sum(-1)  # P(accept d_j | d_0..d_{j-1} accepted) = sum_x min(p_j, q_j)
  for got, want in (((n_acc >= 1).mean(), overlap[0]), ((n_acc == 2).mean(), overlap[0] * overlap[1])):
    assert abs(got - want) < 4.5 * np.sqrt(want * (1 - want) / n)


def exact_token_marginal(params, index, temperature, top_k, top_p):
  """Exact marginal of output token `index` (1 or 2): sum over the tokens before it of the product of their
  sampling probabilities, from the trainer's forward on every continuation."""
  V = CFG.vocab_size
  fwd = jax.jit(model.forward, static_argnames="cfg")
  probs = lambda lg: sampler.sampling_probs_reference(lg, temperature, top_k, top_p)  # noqa: E731
  p0 = probs(np.asarray(fwd(params, np.array([PROMPT], np.int32), cfg=CFG)[0])[0, -1])
  seqs = np.array([list(PROMPT) + [x0] for x0 in range(V)], np.int32)
  logits1 = np.asarray(fwd(params, seqs, cfg=CFG)[0])[:, -1]
  if index == 1:
    return sum(p0[x0] * probs(logits1[x0]) for x0 in range(V))
  seqs = np.array([list(PROMPT) + [x0, x1] for x0 in range(V) for x1 in range(V)], np.int32)
  logits2 = np.asarray(fwd(params, seqs, cfg=CFG)[0])[:, -1]
  return sum(p0[x0] * probs(logits1[x0])[x1] * probs(logits2[x0 * V + x1]) for x0 in range(V) for x1 in range(V))


@pytest.mark.slow
@pytest.mark.parametrize("draft_tokens,index,adaptive", [(0, 1, False), (1, 1, False), (2, 2, False), (2, 2, True)],
                         ids=["plain", "k1_second", "k2_third", "adaptive_third"])
def test_output_token_distribution(draft_tokens, index, adaptive):
  """Token 1 is the first verified draft; with k = 2, token 2 is the first chained draft (or a residual/bonus).
  Adaptive: 16 calls of 256 rows, each with the k (0, 1 or 2) the engine picks, pooled."""
  params = model.init(jax.random.key(4), dataclasses.replace(CFG, initializer_range=0.3))
  temperature, top_k, top_p, n = 0.9, 12, 0.95, 4096
  ecfg = EngineConfig(speculative=draft_tokens > 0, draft_tokens=max(draft_tokens, 1),
                      max_batch=256 if adaptive else 1024, min_prompt_bucket=8, min_len_bucket=8,
                      adaptive_draft=adaptive, draft_probe_every=2)
  eng = JaxEngine(params, CFG, ecfg)
  reqs = [GenerateRequest(PROMPT, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                 max_tokens=index + 1, seed=i)) for i in range(n)]
  tok = np.array([r.output_ids[index] for r in eng.generate(reqs)])
  _close(np.bincount(tok, minlength=CFG.vocab_size) / n, exact_token_marginal(params, index, temperature, top_k,
                                                                              top_p), n)
  if adaptive:   # the calls ran several depths (every k is explored before the engine chooses)
    assert {int(k) for k in eng.version_log.current["k_calls"]} == {0, 1, 2}
  elif draft_tokens:  # the draft path was exercised: some drafts accepted, some rejected
    stats = eng.last_stats
    assert 0 < stats["accepted"] < stats["drafted"]


@pytest.mark.parametrize("draft_tokens", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_greedy_multi_draft_equals_plain(draft_tokens):
  """Greedy speculative output with chained drafts equals plain greedy (tokens, logprobs, routing)."""
  params = model.init(jax.random.key(6), dataclasses.replace(CFG, initializer_range=0.3))
  reqs = [GenerateRequest(tuple(range(i, 2 * i + 3)), SamplingParams(temperature=0.0, max_tokens=16,
                                                                     stop_token_ids=(7,) if i == 2 else ()))
          for i in range(4)]
  ecfg = EngineConfig(min_batch_bucket=4, min_prompt_bucket=8, min_len_bucket=16, draft_tokens=draft_tokens)
  outs = [JaxEngine(params, CFG, dataclasses.replace(ecfg, speculative=s)).generate(reqs) for s in (False, True)]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(a.output_ids, b.output_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


@pytest.mark.slow
def test_greedy_speculative_equals_plain_long():
  """Greedy speculative output equals plain greedy over a longer generation (many accept/reject steps)."""
  params = model.init(jax.random.key(6), dataclasses.replace(CFG, initializer_range=0.3))
  reqs = [GenerateRequest(tuple(range(i, i + 3 + i)), SamplingParams(temperature=0.0, max_tokens=40))
          for i in range(8)]
  outs = [JaxEngine(params, CFG, EngineConfig(speculative=s)).generate(reqs) for s in (False, True)]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(a.output_ids, b.output_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
