"""Prefix reuse in the JaxEngine equals re-prefilling: multi-turn continuations and branches, plain and speculative.

The reference engine clears its prefix cache before every call and prefills whole prompts from scratch (a window
bucket wider than any prompt); the engine under test keeps its cache between turns.
"""
import dataclasses

import jax
import numpy as np
import pytest

from composer_jax import model
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from rollout.engines.protocol import GenerateRequest, SamplingParams
from tests.test_sampling_engine import CFG, STOPS

# One prompt bucket (32) for every turn below, so each engine compiles few programs: both prefill all 32 slots on
# turn 0 (nothing to reuse), then the engine under test runs a window of 16 slots (the new tails).
ECFG = EngineConfig(min_batch_bucket=4, min_prompt_bucket=32, min_len_bucket=8, min_window_bucket=8, max_batch=4)
# Float32 throughout. The reused rows of earlier output tokens were computed by decode steps (absorbed, latent-space
# attention), the re-prefill computes them with expanded keys and values: the same sums in another order, ~1e-6
# apart in every logprob seen; routing must not move at all.
LOGPROB_ATOL = 2e-5
ROWS_ATOL = 1e-4   # latent KV rows (entries of order 1), after up to three turns of such differences


@pytest.fixture(scope="module")
def params():
  return model.init(jax.random.key(0), dataclasses.replace(CFG, initializer_range=0.2))


class Reprefill(JaxEngine):
  """The reference: every call prefills its prompts in full (its cache is emptied before each call)."""

  def generate(self, requests):
    self.prefix_cache.clear()
    return super().generate(requests)


def _sampling(i):
  return [SamplingParams(temperature=0.0, max_tokens=8, seed=i),
          SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=STOPS, seed=i),
          SamplingParams(temperature=0.8, top_k=8, max_tokens=8, seed=i),
          SamplingParams(temperature=1.0, top_p=0.9, max_tokens=7, seed=i)][i % 4]


def _next_turn(reqs, results, rng, turn):
  """Each episode's next prompt: previous prompt + output + 3 'tool' tokens; episode 0 forks into two branches."""
  nxt = []
  for i, (r, res) in enumerate(zip(reqs, results)):
    base = r.prompt_ids + tuple(int(t) for t in res.output_ids)
    for _ in range(2 if i == 0 else 1):
      nxt.append(base + tuple(int(t) for t in rng.integers(0, CFG.vocab_size, size=3)))
  return [GenerateRequest(p, _sampling(10 * turn + i)) for i, p in enumerate(nxt[:4])]


def _assert_same_result(got, want, what):
  np.testing.assert_array_equal(got.output_ids, want.output_ids, err_msg=what)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=LOGPROB_ATOL, err_msg=what)
  np.testing.assert_array_equal(got.routed_experts, want.routed_experts, err_msg=what)
  np.testing.assert_array_equal(got.prompt_routed_experts, want.prompt_routed_experts, err_msg=what)
  assert got.finish_reason == want.finish_reason, what


def _assert_same_entry(got_cache, want_cache, tokens, what):
  """The kept rows (MTP rows as far as both trust them) and routing of one sequence agree."""
  (g, ng), (w, nw) = got_cache.lookup(tokens), want_cache.lookup(tokens)
  assert ng == nw == len(tokens) and len(g.tokens) == len(w.tokens), what
  assert g.mtp_len == w.mtp_len, what
  np.testing.assert_array_equal(g.experts_TxLmxK, w.experts_TxLmxK, err_msg=what)
  assert g.rows.keys() == w.rows.keys()
  for name, kv in w.rows.items():
    n = w.mtp_len if name == "mtp" else len(tokens)
    for key, a in kv.items():
      np.testing.assert_allclose(g.rows[name][key][:, :n], a[:, :n], atol=ROWS_ATOL, err_msg=f"{what} {name}.{key}")


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_continuations_equal_reprefill(params, speculative):
  """Three turns of four episodes (one forking into two branches): same tokens, logprobs to 2e-5, identical routing
  of outputs and prompts, the same kept rows; from the second turn on most prompt tokens are reused."""
  ecfg = dataclasses.replace(ECFG, speculative=speculative)
  engine = JaxEngine(params, CFG, ecfg)
  reference = Reprefill(params, CFG, dataclasses.replace(ecfg, min_window_bucket=1024))
  rng = np.random.default_rng(0)
  reqs = [GenerateRequest(tuple(int(t) for t in rng.integers(0, CFG.vocab_size, size=n)), _sampling(i))
          for i, n in enumerate((5, 9, 3, 7))]
  for turn in range(3):
    got, want = engine.generate(reqs), reference.generate(reqs)
    stats = engine.last_stats
    assert reference.last_stats["prefix_reused_tokens"] == 0
    if turn:
      assert stats["prefix_reused_tokens"] >= stats["prompt_tokens"] // 2, stats
      assert stats["prefill_window"] < reference.last_stats["prefill_window"], (stats, reference.last_stats)
    if speculative:
      assert stats["drafted"] > 0
    for i, (r, g, w) in enumerate(zip(reqs, got, want)):
      _assert_same_result(g, w, f"turn {turn} request {i}")
      _assert_same_entry(engine.prefix_cache, reference.prefix_cache,
                         np.concatenate([np.asarray(r.prompt_ids), w.output_ids]).astype(np.int32),
                         f"turn {turn} request {i}")
    reqs = _next_turn(reqs, got, rng, turn + 1)


def test_weight_update_empties_the_cache_and_the_bound_holds(params):
  """Rows of old weights are never reused; the cache never holds more bytes than configured."""
  bound = 40 * 260   # 40 tokens of 3 layers x (16 + 4) float32 (no MTP rows: plain) + the token + 2 x 2 experts
  engine = JaxEngine(params, CFG, dataclasses.replace(ECFG, prefix_cache_bytes=bound))
  rng = np.random.default_rng(1)
  reqs = [GenerateRequest(tuple(int(t) for t in rng.integers(0, CFG.vocab_size, size=9)), _sampling(i))
          for i in range(4)]
  for turn in range(2):
    results = engine.generate(reqs)
    assert 0 < engine.prefix_cache.nbytes <= bound
    reqs = _next_turn(reqs, results, rng, turn + 1)
  new = model.init(jax.random.key(5), dataclasses.replace(CFG, initializer_range=0.2))
  engine.update_weights(new, policy_version=1)
  assert engine.prefix_cache.nbytes == 0
  got = engine.generate(reqs)
  assert engine.last_stats["prefix_reused_tokens"] == 0
  for i, (g, w) in enumerate(zip(got, JaxEngine(new, CFG, ECFG, policy_version=1).generate(reqs))):
    _assert_same_result(g, w, f"request {i}")


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_window_prefill_and_decode_lower_for_cuda(params, speculative):
  """The prefill over reused rows (a window narrower than the prompt) and the decode program after it lower for GPU,
  not only for this CPU."""
  from composer_jax.sampling import engine as engine_lib
  engine = JaxEngine(params, CFG, dataclasses.replace(ECFG, speculative=speculative))
  reqs = [GenerateRequest((1, 2, 3, 4, 5, 6, 7, 8, 9), _sampling(i)) for i in range(2)]
  results = engine.generate(reqs)
  batch, Lo, window = engine._batch(_next_turn(reqs, results, np.random.default_rng(0), 1))
  P, k = batch.prompts_UxP.shape[1], engine._draft_tokens
  assert 0 < window < P
  static = dict(cfg=engine.cfg, **engine.prefill_static(P, Lo, window))
  prefill = engine_lib._prefill.trace(engine.params, batch, **static)
  assert prefill.lower(lowering_platforms=("cuda",)).as_text()
  cache, logits, h, _ = jax.eval_shape(lambda: engine_lib._prefill(engine.params, batch, **static))
  decode_batch = batch._replace(prefix_cache=None, prefix_experts_LmxUxPxK=None)
  lowered = engine_lib._decode.trace(engine.params, decode_batch, cache, logits, h, cfg=engine.cfg, max_len=Lo,
                                     draft_tokens=k).lower(lowering_platforms=("cuda",))
  assert "while" in lowered.as_text()
