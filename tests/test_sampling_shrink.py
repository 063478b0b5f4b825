"""Plain decoding that shrinks to its live rows (`EngineConfig.shrink_rows`) against decoding the whole batch to the
end: the same tokens, routing and kept prefix rows; the stages merged back in row order."""
import dataclasses

import jax
import numpy as np
import pytest

from composer_jax import model
from composer_jax.sampling import decode as decode_lib
from composer_jax.sampling import shrinking
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from rollout.engines.protocol import GenerateRequest, SamplingParams
from tests.test_sampling_engine import CFG, STOPS

ECFG = EngineConfig(min_batch_bucket=16, min_prompt_bucket=16, min_len_bucket=16, max_batch=16)


def _requests(seed: int, temperature: float) -> list[GenerateRequest]:
  """16 rows that end at many different steps: max_tokens from 1 to 16, a third of them with stop ids."""
  rng = np.random.default_rng(seed)
  prompts = [tuple(int(t) for t in rng.integers(0, 64, size=n)) for n in rng.integers(1, 12, size=16)]
  prompts[5] = prompts[4]   # a duplicated prompt: prefilled once, its cache copied to both rows
  return [GenerateRequest(p, SamplingParams(temperature=temperature, max_tokens=int(rng.integers(1, 17)), seed=b,
                                            stop_token_ids=STOPS if b % 3 == 0 else ()), request_id=str(b))
          for b, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def params():
  return model.init(jax.random.key(1), dataclasses.replace(CFG, initializer_range=0.2))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shrinking_decode_equals_the_whole_batch(params, temperature):
  engines = {n: JaxEngine(params, CFG, dataclasses.replace(ECFG, shrink_rows=n)) for n in (0, 2)}
  reqs, out = _requests(0, temperature), None
  for _ in range(2):   # the second turn continues every row through the prefix cache
    if out is not None:
      reqs = [GenerateRequest(r.prompt_ids + tuple(int(t) for t in o.output_ids) + (1, 2), r.params, r.request_id)
              for r, o in zip(reqs, out[0], strict=True)]
    out = {n: e.generate(reqs) for n, e in engines.items()}
    lengths = [len(o.output_ids) for o in out[0]]
    assert len(set(lengths)) > 4   # rows end at many steps, so the batch shrinks more than once
    for a, b in zip(out[0], out[2], strict=True):
      np.testing.assert_array_equal(a.output_ids, b.output_ids)
      np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
      np.testing.assert_array_equal(a.prompt_routed_experts, b.prompt_routed_experts)
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
      np.testing.assert_allclose(a.entropies, b.entropies, atol=1e-5)
      assert a.finish_reason == b.finish_reason
    assert engines[2].last_stats["steps"] == engines[0].last_stats["steps"] == max(lengths)
    assert engines[2].last_stats["prefix_reused_tokens"] == engines[0].last_stats["prefix_reused_tokens"]
  stages = {key[0] for key in engines[2]._programs}
  assert "decode_more" in stages and "_decode" not in stages   # it shrank (16 -> 8 -> 4 -> 2 rows)
  assert {key[0] for key in engines[0]._programs} == {"_prefill", "_decode"}


def test_shrinking_decode_without_the_prefix_cache(params):
  """With the prefix cache off the stages are fetched without their caches: the same outputs as the whole batch."""
  engines = {n: JaxEngine(params, CFG, dataclasses.replace(ECFG, shrink_rows=n, prefix_cache_bytes=0)) for n in (0, 2)}
  out = {n: e.generate(_requests(1, 1.0)) for n, e in engines.items()}
  for a, b in zip(out[0], out[2], strict=True):
    np.testing.assert_array_equal(a.output_ids, b.output_ids)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  assert "decode_more" in {key[0] for key in engines[2]._programs}


def _state(B: int, i: int, value: float, end: list[int]) -> decode_lib.State:
  full = lambda *shape: np.full((B, *shape), value, np.float32)   # noqa: E731
  return decode_lib.State(np.int32(i), full(), {"layer": [{"c": full(3)}]}, full(4), full(4), full(4), full(4, 1, 1),
                          np.asarray(end, np.int32))


def test_merge_stages_takes_each_row_from_the_stage_it_ended_in():
  # Stage 0: 4 rows; rows 1 and 3 go on as stage 1 (with one filler), row 3 alone as stage 2.
  stages = [(np.arange(4), _state(4, 2, 0.0, [1, 9, 2, 9])),
            (np.array([1, 3, -1, -1]), _state(4, 5, 1.0, [4, 9, 1, 1])),
            (np.array([3, -1]), _state(2, 7, 2.0, [7, 1]))]
  got = shrinking.merge_stages(stages)
  assert got.i == 7
  np.testing.assert_array_equal(got.end_B, [1, 4, 2, 7])
  np.testing.assert_array_equal(got.toks_BxLo[:, 0], [0.0, 1.0, 0.0, 2.0])
  np.testing.assert_array_equal(got.cache["layer"][0]["c"][:, 0], [0.0, 1.0, 0.0, 2.0])
  assert got.routes_BxLoxLmxK.shape == (4, 4, 1, 1)
  # Stages fetched without their caches (the prefix cache off) merge the same, with no cache.
  bare = shrinking.merge_stages([(orig, st._replace(cache=None)) for orig, st in stages])
  assert bare.cache is None
  np.testing.assert_array_equal(bare.toks_BxLo, got.toks_BxLo)


def test_shrinking_programs_lower_for_cuda(params):
  """Both stages' programs lower for GPU, not only for this CPU."""
  from composer_jax.sampling import engine as engine_lib
  from composer_jax.sampling.shrinking import decode_more, decode_start
  engine = JaxEngine(params, CFG, dataclasses.replace(ECFG, shrink_rows=2))
  batch, Lo, window = engine._batch(_requests(0, 1.0))
  P = batch.prompts_UxP.shape[1]
  static = dict(cfg=engine.cfg, **engine.prefill_static(P, Lo, window))
  cache, logits, _, _ = jax.eval_shape(lambda: engine_lib._prefill(engine.params, batch, **static))
  start = decode_start.trace(engine.params, batch, cache, logits, cfg=engine.cfg, max_len=Lo, until_live=8)
  assert start.lower(lowering_platforms=("cuda",)).as_text()
  rows, state = jax.eval_shape(lambda: decode_start(engine.params, batch, cache, logits, cfg=engine.cfg, max_len=Lo,
                                                    until_live=8))
  idx = jax.ShapeDtypeStruct((8,), np.int32)
  more = decode_more.trace(engine.params, rows, state, idx, cfg=engine.cfg, P=P, until_live=4)
  assert "while" in more.lower(lowering_platforms=("cuda",)).as_text()
