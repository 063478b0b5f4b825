"""The JaxEngine (plain and MTP-speculative) against the trainer's forward and a naive greedy reference."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.sampling.engine import EngineConfig, JaxEngine, sample
from rollout.engines.protocol import Engine, GenerateRequest, SamplingParams

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, num_nextn_predict_layers=1)
# One bucket (B = U = 8, P = 8, T = 8) for every call below, so each engine compiles once.
ECFG = EngineConfig(min_batch_bucket=8, min_prompt_bucket=8, min_len_bucket=8, max_batch=8)
STOPS = tuple(range(0, 64, 3))  # a third of the vocabulary: some rows stop early


def _requests(seed=0):
  rng = np.random.default_rng(seed)
  prompts = [tuple(int(t) for t in rng.integers(0, 64, size=n)) for n in (3, 8, 5, 5, 1, 6, 4, 7)]
  prompts[3] = prompts[2]  # a duplicated prompt (prefilled once, cache copied)
  params = [SamplingParams(temperature=0.0, max_tokens=8, seed=1),
            SamplingParams(temperature=1.0, max_tokens=5, seed=2),
            SamplingParams(temperature=0.7, top_k=5, max_tokens=8, seed=3),
            SamplingParams(temperature=0.7, top_k=5, max_tokens=8, seed=4),
            SamplingParams(temperature=1.3, top_p=0.9, max_tokens=3, seed=5),
            SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=STOPS, seed=6),
            SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=STOPS, seed=7),
            SamplingParams(temperature=1.0, top_k=1, max_tokens=7, seed=8)]
  return [GenerateRequest(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(prompts, params))]


@pytest.fixture(scope="module")
def params():
  return model.init(jax.random.key(0), dataclasses.replace(CFG, initializer_range=0.2))


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "speculative"])
def engine(request, params):
  return JaxEngine(params, CFG, dataclasses.replace(ECFG, speculative=request.param))


@functools.partial(jax.jit, static_argnames="cfg")
def trainer_forward(params, tokens_BxL, pad_B, cfg):
  """What the RL trainer runs on left-padded rows: padding is segment 0, positions count real tokens only."""
  slots = jnp.arange(tokens_BxL.shape[1])[None, :]
  valid = slots >= pad_B[:, None]
  return model.forward(params, tokens_BxL, cfg, segment_ids=valid.astype(jnp.int32),
                       positions=jnp.where(valid, slots - pad_B[:, None], 0))


def _padded(rows, width):
  toks = np.zeros((len(rows), width), np.int32)
  for b, r in enumerate(rows):
    toks[b, width - len(r):] = r
  return jnp.asarray(toks), jnp.asarray([width - len(r) for r in rows], jnp.int32)


def naive_greedy(params, prompts, n_tokens, cfg=CFG, width=16):
  """Reference: recompute the full forward for every new token and take the argmax."""
  rows = [list(p) for p in prompts]
  for _ in range(n_tokens):
    toks, pad = _padded(rows, width)
    logits, _ = trainer_forward(params, toks, pad, cfg)
    for b in range(len(rows)):
      rows[b].append(int(jnp.argmax(logits[b, -1])))
  return [r[len(p):] for r, p in zip(rows, prompts)]


def test_is_a_rollout_engine(engine):
  assert isinstance(engine, Engine)


def test_outputs_match_trainer_forward(engine, params):
  """Logprobs equal the trainer's tempered log-softmax (<= 1e-3; ~1e-6 seen) and routing (prompt too) is identical."""
  reqs = _requests()
  results = engine.generate(reqs)
  assert len(results) == len(reqs)
  rows = [list(r.prompt_ids) + list(res.output_ids) for r, res in zip(reqs, results)]
  toks, pad = _padded(rows, 16)
  logits, aux = trainer_forward(params, toks, pad, CFG)
  for b, (req, res) in enumerate(zip(reqs, results)):
    sp, n = req.params, len(res.output_ids)
    assert 1 <= n <= sp.max_tokens and res.policy_version == 0
    stops = [i for i, t in enumerate(res.output_ids) if t in sp.stop_token_ids]
    if res.finish_reason == "stop":
      assert stops == [n - 1]
    else:
      assert res.finish_reason == "length" and n == sp.max_tokens and not stops
    out = slice(16 - n - 1, 15)  # logits that predict the output tokens
    lp = jax.nn.log_softmax(logits[b, out] / (sp.temperature or 1.0), axis=-1)
    want = np.take_along_axis(np.asarray(lp), res.output_ids[:, None], 1)[:, 0]
    np.testing.assert_allclose(res.logprobs, want, atol=1e-3, err_msg=f"request {b}")
    assert res.routed_experts.shape == (n, CFG.num_hidden_layers - 1, CFG.num_experts_per_tok)
    np.testing.assert_array_equal(res.routed_experts, np.transpose(aux["experts"][:, b, 16 - n:], (1, 0, 2)))
    P = len(req.prompt_ids)   # the prefill's routing of the prompt, as the trainer's forward routes it
    np.testing.assert_array_equal(res.prompt_routed_experts,
                                  np.transpose(aux["experts"][:, b, 16 - n - P:16 - n], (1, 0, 2)))
    # Each token's entropy: of the policy (tempered, full vocabulary) it was drawn from; the speculative path
    # reports none.
    if engine.engine_cfg.speculative:
      assert res.entropies is None
    else:
      z = np.asarray(logits[b, out], np.float64) / (sp.temperature or 1.0)
      p = np.exp(z - z.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      np.testing.assert_allclose(res.entropies, -np.sum(p * np.log(p), -1), rtol=1e-4, err_msg=f"request {b}")
    if sp.top_k == 1 or sp.temperature == 0:  # greedy rows: every token is the argmax
      np.testing.assert_array_equal(res.output_ids, np.argmax(logits[b, out], -1))
  assert any(r.finish_reason == "stop" for r in results)


def test_greedy_equals_naive_reference(engine, params):
  reqs = [GenerateRequest(r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=8)) for r in _requests(1)]
  results = engine.generate(reqs)
  want = naive_greedy(params, [r.prompt_ids for r in reqs], 8)
  for res, w in zip(results, want):
    np.testing.assert_array_equal(res.output_ids, w)


def test_seeds_make_rows_reproducible(engine):
  req = GenerateRequest((5, 6, 7), SamplingParams(temperature=1.0, max_tokens=8, seed=11))
  other = GenerateRequest((5, 6, 7), SamplingParams(temperature=1.0, max_tokens=8, seed=12))
  a = engine.generate([req, other, req] + _requests()[:5])
  b = engine.generate(_requests(2)[:4] + [req, req, other, other])
  for x in (a[2], b[4], b[5]):  # the same seed gives the same tokens, whatever else is in the batch
    np.testing.assert_array_equal(x.output_ids, a[0].output_ids)
  np.testing.assert_array_equal(a[1].output_ids, b[7].output_ids)
  assert not np.array_equal(a[0].output_ids, a[1].output_ids)


def test_unseeded_requests_differ():
  eng = JaxEngine(model.init(jax.random.key(0), dataclasses.replace(CFG, initializer_range=0.2)), CFG, ECFG)
  reqs = [GenerateRequest((1, 2), SamplingParams(temperature=1.0, max_tokens=8))] * 8
  outs = {tuple(r.output_ids) for r in eng.generate(reqs)}
  assert len(outs) > 1


def test_update_weights_in_place(params):
  eng = JaxEngine(params, CFG, ECFG, policy_version=3)
  reqs = [GenerateRequest(r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=8)) for r in _requests(3)]
  before = eng.generate(reqs)
  new = model.init(jax.random.key(5), dataclasses.replace(CFG, initializer_range=0.2))
  eng.update_weights(new, policy_version=4)
  after = eng.generate(reqs)
  assert {r.policy_version for r in before} == {3} and {r.policy_version for r in after} == {4}
  want = naive_greedy(new, [r.prompt_ids for r in reqs], 8)
  for res, w in zip(after, want):
    np.testing.assert_array_equal(res.output_ids, w)
  assert any(not np.array_equal(x.output_ids, y.output_ids) for x, y in zip(before, after))
  with pytest.raises(ValueError, match="tree structure"):
    eng.update_weights({"embed": new["embed"]}, policy_version=5)


def test_sample_function(params):
  res = sample(params, [[1, 2, 3], [4]], CFG, max_tokens=4, temperature=0.0, engine_cfg=ECFG)
  want = naive_greedy(params, [[1, 2, 3], [4]], 4)
  assert [list(r.output_ids) for r in res] == want


def test_bad_requests_raise(params):
  eng = JaxEngine(params, CFG, ECFG)
  with pytest.raises(ValueError, match="empty prompt"):
    eng.generate([GenerateRequest((), SamplingParams())])
  with pytest.raises(ValueError, match="outside"):
    eng.generate([GenerateRequest((1, 64), SamplingParams())])
  with pytest.raises(ValueError, match="max_position_embeddings"):
    JaxEngine(params, dataclasses.replace(CFG, max_position_embeddings=12), ECFG).generate(
        [GenerateRequest((1,), SamplingParams(max_tokens=8))])
  with pytest.raises(ValueError, match="MTP"):
    JaxEngine(params, dataclasses.replace(CFG, num_nextn_predict_layers=0), EngineConfig(speculative=True))
