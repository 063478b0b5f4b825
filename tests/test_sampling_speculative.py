"""MTP speculative decoding keeps the sampling distribution: the second output token (the first one that goes
through draft + verify) against its exact marginal, computed from the trainer's forward."""

import jax
import numpy as np
import pytest

from composer_jax import model
from composer_jax.sampling import sampler
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from composer_jax.sampling.random_params import random_params
from rollout.engines.protocol import GenerateRequest, SamplingParams

CFG = model.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, num_nextn_predict_layers=1)
PROMPT = (3, 1, 4, 1, 5)


def exact_second_token(params, temperature, top_k, top_p):
  """Exact marginal of output token 1: sum over token 0 of p(x0) p(x1 | x0), each under the sampling transform."""
  V = CFG.vocab_size
  seqs = np.array([list(PROMPT) + [x0] for x0 in range(V)], np.int32)
  logits, _ = jax.jit(model.forward, static_argnames="cfg")(params, seqs, cfg=CFG)
  logits = np.asarray(logits)
  p0 = sampler.sampling_probs_reference(logits[0, len(PROMPT) - 1], temperature, top_k, top_p)
  return sum(p0[x0] * sampler.sampling_probs_reference(logits[x0, -1], temperature, top_k, top_p)
             for x0 in range(V))


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [False, True])
def test_second_token_distribution(speculative):
  params = random_params(CFG, seed=4, std=0.3)
  temperature, top_k, top_p, n = 0.9, 12, 0.95, 4096
  ecfg = EngineConfig(speculative=speculative, max_batch=1024, min_prompt_bucket=8, min_len_bucket=8)
  eng = JaxEngine(params, CFG, ecfg)
  reqs = [GenerateRequest(PROMPT, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=2,
                                                 seed=i)) for i in range(n)]
  second = np.array([r.output_ids[1] for r in eng.generate(reqs)])
  want = exact_second_token(params, temperature, top_k, top_p)
  freq = np.bincount(second, minlength=CFG.vocab_size) / n
  # 4.5 binomial standard deviations per token (false-alarm probability < 1e-4 over the vocabulary).
  np.testing.assert_array_less(np.abs(freq - want), 4.5 * np.sqrt(want * (1 - want) / n) + 1e-9)
  if speculative:  # the draft path was exercised: some drafts accepted, some rejected
    stats = eng.last_stats
    assert 0 < stats["accepted"] < stats["drafted"]


@pytest.mark.slow
def test_greedy_speculative_equals_plain_long():
  """Greedy speculative output equals plain greedy over a longer generation (many accept/reject steps)."""
  params = random_params(CFG, seed=6, std=0.3)
  reqs = [GenerateRequest(tuple(range(i, i + 3 + i)), SamplingParams(temperature=0.0, max_tokens=40))
          for i in range(8)]
  outs = [JaxEngine(params, CFG, EngineConfig(speculative=s)).generate(reqs) for s in (False, True)]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(a.output_ids, b.output_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
