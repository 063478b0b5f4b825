"""A real SGLang server on CPU serving our exported DeepSeek-V3 model, checked against our own forward.

One server start for the whole module (66 s on a loaded 2-core machine; the module took 107 s). float32 on
both sides, so the only differences are summation order: greedy tokens must be identical, logprobs within 1e-2
(observed ~1e-6) and routing (expert sets per token and layer) ≥ 99% equal (observed 100%).
"""
import json
import os

import numpy as np
import pytest
import sglang_testlib as lib

from rollout.engines.protocol import Engine, GenerateRequest, SamplingParams
from rollout.engines.sglang_fleet import FleetConfig, SGLangFleet
from rollout.engines.sglang_launcher import ServerConfig

PROMPT_LEN, MAX_TOKENS = 6, 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
  lib.require_sglang()
  root = tmp_path_factory.mktemp("sglang")
  ckpt = lib.save_checkpoint(str(root / "v0"), seed=0)
  f = SGLangFleet(FleetConfig(ServerConfig(ckpt, max_total_tokens=4096)), log_dir=str(root / "logs"))
  yield f
  f.close()  # module finalizer: runs even when a test failed, and kills the server's whole process group
  assert not any(s.alive() for s in f.servers)


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [tuple(int(t) for t in rng.integers(2, lib.CFG.vocab_size, PROMPT_LEN)) for _ in range(n)]


def _check_against_reference(results, prompts, seed):
  agree, prompt_agree = [], []
  for prompt, r in zip(prompts, results, strict=True):
    greedy, logprobs, experts, _ = lib.reference(seed, prompt, r.output_ids)
    np.testing.assert_array_equal(r.output_ids, greedy)
    np.testing.assert_allclose(r.logprobs, logprobs, atol=1e-2, rtol=0)  # f32 both sides: summation order only
    assert r.routed_experts.shape == experts.shape
    agree.append(lib.routing_agreement(r.routed_experts, experts))
    prompt_agree.append(lib.routing_agreement(r.prompt_routed_experts, lib.prompt_experts(seed, prompt)))
  assert np.mean(agree) >= 0.99, agree
  assert np.mean(prompt_agree) >= 0.99, prompt_agree   # the prefill's routing, from the same log


def test_greedy_batch_of_16_matches_our_forward(fleet):
  assert isinstance(fleet, Engine)
  assert all(fleet.health().values())
  prompts = _prompts(16)
  results = fleet.generate([GenerateRequest(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                            request_id=f"g{i}") for i, p in enumerate(prompts)])
  assert [len(r.output_ids) for r in results] == [MAX_TOKENS] * 16
  assert {r.finish_reason for r in results} == {"length"} and {r.policy_version for r in results} == {0}
  _check_against_reference(results, prompts, seed=0)


def test_stop_token_ends_the_sample_and_is_kept(fleet):
  prompt = _prompts(1, seed=1)[0]
  full = fleet.generate([GenerateRequest(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))])[0]
  eos = json.load(open(os.path.join(fleet.cfg.server.model_path, "config.json")))["eos_token_id"]
  j = next(j for j in range(1, MAX_TOKENS) if full.output_ids[j] not in full.output_ids[:j])
  stop = int(full.output_ids[j])
  r = fleet.generate([GenerateRequest(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                             stop_token_ids=(stop,)))])[0]
  # With stop ids, the checkpoint's EOS stops too (see sglang_client.to_payload).
  cut = next(i for i, t in enumerate(full.output_ids) if t in (stop, eos))
  np.testing.assert_array_equal(r.output_ids, full.output_ids[:cut + 1])
  assert r.finish_reason == "stop" and r.routed_experts.shape[0] == cut + 1


def test_top_k_sampling(fleet):
  """Every sampled token is in our forward's top-k, and logprobs are our forward's (at temperature 1).

  Per-request seeds are not checked: SGLang honours `sampling_seed` only with --enable-deterministic-inference,
  which needs a GPU attention backend (see ServerConfig.deterministic).
  """
  k = 3
  prompts = _prompts(4, seed=2)
  results = fleet.generate([GenerateRequest(p, SamplingParams(temperature=1.0, top_k=k, max_tokens=MAX_TOKENS))
                            for p in prompts])
  greedy_like = 0
  for prompt, r in zip(prompts, results, strict=True):
    greedy, logprobs, _, logp_TxV = lib.reference(0, prompt, r.output_ids)
    topk = np.argsort(-logp_TxV, -1)[:, :k]
    assert all(t in row for t, row in zip(r.output_ids, topk, strict=True))
    greedy_like += int((greedy == r.output_ids).all())
    # SGLang reports log-probs of the full distribution (before top-k renormalisation): what the trainer computes.
    np.testing.assert_allclose(r.logprobs, logprobs, atol=1e-2, rtol=0)
  assert greedy_like < len(prompts)  # it really sampled (all-greedy by chance: < 1e-3 at these logits)


def test_update_weights_then_version_and_outputs_follow(fleet, tmp_path):
  ckpt1 = lib.save_checkpoint(str(tmp_path / "v1"), seed=1)
  seconds = fleet.update_weights(ckpt1, version=1)
  assert 0 < seconds < 60
  prompts = _prompts(4, seed=3)
  results = fleet.generate([GenerateRequest(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
                            for p in prompts])
  assert {r.policy_version for r in results} == {1} and fleet.policy_version == 1
  _check_against_reference(results, prompts, seed=1)
  with pytest.raises(ValueError, match="must not go back"):
    fleet.update_weights(ckpt1, version=0)
