"""Adaptive draft depth and the per-version speculative log: the chooser against hand-computed values, the log's
lines and metrics, and an adaptive engine whose changing k never changes greedy output."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from composer_jax import model
from composer_jax.sampling.draft_depth import DraftDepth
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from composer_jax.sampling.spec_log import VersionLog, VersionLogReader, summary
from rollout.engines.protocol import GenerateRequest, SamplingParams


def test_acceptance_and_tokens_per_step_from_run_lengths():
  d = DraftDepth(max_k=2)
  # 10 row-steps at k = 2: n = 0 twice, n = 1 three times, n = 2 five times.
  d.record(2, "s", np.array([2, 3, 5]), None, 0)
  # draft 0 reached 10 times, accepted 8; draft 1 reached 8 times, accepted 5.
  np.testing.assert_allclose(d.acceptance(), [0.8, 5 / 8])
  assert d.tokens_per_step(0) == 1.0
  np.testing.assert_allclose(d.tokens_per_step(1), 1.8)
  np.testing.assert_allclose(d.tokens_per_step(2), 1 + 0.8 + 0.8 * 5 / 8)   # = 1 + (8 + 5) / 10 accepted per step
  # A k = 1 call adds to draft 0 only: 4 row-steps, 1 accepted.
  d.record(1, "s", np.array([3, 1]), None, 0)
  np.testing.assert_allclose(d.acceptance(), [9 / 14, 5 / 8])
  d.new_policy()                                     # halving keeps the rates, weighs new counts double
  np.testing.assert_allclose(d.acceptance(), [9 / 14, 5 / 8])
  d.record(1, "s", np.array([7, 0]), None, 0)
  np.testing.assert_allclose(d.acceptance()[0], 4.5 / 14)


def _explore(d, shape, cost_ms, hist):
  """The first call: every k decoded on one prefill, K..0 (untimed: each program's first run, here 10x slower),
  then 0..K and K..0 at `cost_ms[k]` per step (10 steps)."""
  ks, why = d.pick(shape, lambda k: False)
  assert why == "explore" and ks == [2, 1, 0, 0, 1, 2, 2, 1, 0]
  for i, k in enumerate(ks):
    d.record(k, shape, hist[k], cost_ms[k] * 1e-2 * (10 if i < 3 else 1), 10)
  assert d.settle()


def test_explores_every_depth_on_the_first_call_then_takes_the_most_tokens_per_second():
  d = DraftDepth(max_k=2, probe_every=3)
  # Acceptance a = (0.8, 0.625) over the k = 2 runs (10 row-steps each, all three counted), nothing new from k = 1:
  # E = 1, 1.8, 2.3.
  _explore(d, "s", {0: 1.0, 1: 1.4, 2: 2.2}, {0: None, 1: np.array([0, 0]), 2: np.array([2, 3, 5])})
  np.testing.assert_allclose(d.acceptance(), [0.8, 0.625])
  # tokens/s per row: k=0 1 / 1.0 ms = 1000; k=1 1.8 / 1.4 ms = 1286; k=2 2.3 / 2.2 ms = 1045 -> k = 1.
  assert d.chosen == 1 and d.explored_shape == "s"
  np.testing.assert_allclose(d.relative_rate(2, 1), (2.3 / 2.2) / (1.8 / 1.4))
  np.testing.assert_allclose(d.step_cost(1, "s"), 1.4e-3)
  assert d.step_cost(1, "t") is None                 # costs are per decode shape
  assert "k=1: 1.80 tok/step, 1.40 ms/step, 1286 tok/s/row" in d.describe("s")


def test_probes_only_shapes_where_other_depths_are_compiled_and_switches_with_hysteresis():
  d = DraftDepth(max_k=2, probe_every=2, margin=0.05)
  _explore(d, "s", {0: 1.0, 1: 1.4, 2: 2.2}, {0: None, 1: np.array([0, 0]), 2: np.array([2, 3, 5])})
  compiled_on_s = lambda k: True                     # noqa: E731  every k was compiled on "s" by the exploration
  only_chosen = lambda k: k == 1                     # noqa: E731  a shape met after it: only the chosen k compiled
  # A shape where only k = 1 exists never probes (a probe there would compile); on "s" every 2nd call probes,
  # the other depths in turn.
  got = [d.pick("t", only_chosen) for _ in range(5)]
  assert got == [([1], "best")] * 5
  got = [d.pick("s", compiled_on_s) for _ in range(4)]
  assert got == [([1], "best"), ([2], "probe"), ([1], "best"), ([0], "probe")]
  # k = 2's steps get cheaper, to 3% more tokens/s than k = 1: (2.3 / 1.8) · 1.4 ms / d2 = 1.03. Within the
  # margin, the choice stays (the window of 8 runs now holds only the new cost).
  d2 = 2.3 / 1.8 * 1.4e-3 / 1.03
  for _ in range(8):
    d.record(2, "s", None, d2 * 10, 10)
  np.testing.assert_allclose(d.relative_rate(2, 1), 1.03, rtol=1e-9)
  assert not d.settle() and d.chosen == 1
  # The drafts get better: 400 more row-steps accepting both drafts, a = (424 / 430, 415 / 424), so
  # E(2) / E(1) = (1 + a0 + a0 a1) / (1 + a0) and k = 2 beats k = 1 by more than the margin -> switch.
  for _ in range(40):
    d.record(2, "s", np.array([0, 0, 10]), None, 0)
  a0, a1 = 424 / 430, 415 / 424
  np.testing.assert_allclose(d.relative_rate(2, 1), (1 + a0 + a0 * a1) / (1 + a0) * 1.4e-3 / d2, rtol=1e-9)
  assert d.settle() and d.chosen == 2


def test_a_first_exploration_where_no_depth_beats_the_largest_keeps_it():
  d = DraftDepth(max_k=2)
  _explore(d, "s", {0: 1.0, 1: 1.0, 2: 1.0}, {0: None, 1: np.array([5, 5]), 2: np.array([0, 0, 10])})
  assert d.chosen == 2


def test_version_log_lines_and_metrics(tmp_path):
  path = tmp_path / "engines" / "w0.jsonl"
  logged = []
  log = VersionLog(str(path), "w0", logged.append)
  log.add(3, False, 2, drafted=20, accepted=12, row_steps=10, tokens=30, seconds=None)   # compiled
  log.add(3, False, 0, drafted=0, accepted=0, row_steps=0, tokens=16, seconds=0.5)
  log.add(3, True, 2, drafted=10, accepted=9, row_steps=5, tokens=14, seconds=0.25)
  reader = VersionLogReader(str(tmp_path / "engines"))
  assert reader.metrics() == {}                      # version 3 still being served: nothing written
  log.add(4, False, 1, drafted=8, accepted=2, row_steps=8, tokens=10, seconds=0.1)   # new version: 3 is written
  (line,) = [json.loads(x) for x in path.read_text().splitlines()]
  assert line["version"] == 3 and line["calls"] == 3 and line["k_calls"] == {"2": 2, "0": 1}
  assert line["sampled"] == {"drafted": 20, "accepted": 12, "row_steps": 10} and line["tokens"] == 60
  m = reader.metrics()
  want = {"spec/version": 3.0, "spec/draft_tokens_mean": 4 / 3, "spec/acceptance_sampled": 0.6,
          "spec/tokens_per_forward_sampled": 2.2, "spec/acceptance_greedy": 0.9,
          "spec/tokens_per_forward_greedy": 2.8, "spec/decode_tokens_per_s": 30 / 0.75}
  assert m.keys() == want.keys()
  for k, v in want.items():
    np.testing.assert_allclose(m[k], v, err_msg=k)
  assert reader.metrics() == {}                      # read once
  assert logged and logged[0].startswith("engine w0 v3:")
  # A half-written line waits; two engines' lines of one version are summed.
  other = tmp_path / "engines" / "w1.jsonl"
  log.flush()
  w1 = {**line, "engine": "w1", "version": 4, "sampled": {"drafted": 8, "accepted": 6, "row_steps": 8}}
  other.write_text(json.dumps(w1)[:20])
  np.testing.assert_allclose(reader.metrics()["spec/acceptance_sampled"], 2 / 8)
  other.write_text(json.dumps(w1) + "\n")
  np.testing.assert_allclose(reader.metrics()["spec/acceptance_sampled"], 6 / 8)
  np.testing.assert_allclose(summary([json.loads(path.read_text().splitlines()[1]), w1])["spec/acceptance_sampled"],
                             8 / 16)


CFG = model.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, num_nextn_predict_layers=1)


def test_adaptive_engine_changes_k_between_calls_and_greedy_output_stays_plain(tmp_path):
  params = model.init(jax.random.key(6), dataclasses.replace(CFG, initializer_range=0.3))
  reqs = [GenerateRequest(tuple(range(i, 2 * i + 3)), SamplingParams(temperature=0.0, max_tokens=12))
          for i in range(4)]
  ecfg = EngineConfig(min_batch_bucket=4, min_prompt_bucket=8, min_len_bucket=16, prefix_cache_bytes=0)
  plain = JaxEngine(params, CFG, ecfg).generate(reqs)
  logged = []
  eng = JaxEngine(params, CFG, dataclasses.replace(ecfg, speculative=True, draft_tokens=1, adaptive_draft=True,
                                                   draft_probe_every=2),
                  stats_path=str(tmp_path / "e.jsonl"), name="e", log_fn=logged.append)
  ks = []
  for _ in range(6):
    for a, b in zip(plain, eng.generate(reqs)):
      np.testing.assert_array_equal(a.output_ids, b.output_ids)
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    ks.append(eng.last_stats["draft_tokens"])
  # Call 1 decoded its prefill with k = 1, 0, 0, 1, 1, 0 and returned k = 1's output; then the choice runs, and every
  # 2nd call probes the other k than the one chosen (compiled for this shape by the exploration; a probe may switch
  # the choice, timings on a busy CPU being close at this size).
  assert ks[0] == 1 and ks[2] != ks[1] and ks[4] != ks[3]
  assert eng.compiles == 3                           # one prefill program for both k, one decode program per k
  assert eng.last_stats["compiles"] == 0 and eng.last_stats["decode_s"] > 0
  assert any(line.startswith("engine e: draft depth k=") for line in logged)
  eng.update_weights(params, policy_version=1)       # the served version's line is written
  (line,) = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
  assert line["version"] == 0 and line["calls"] == 6 and sum(line["k_calls"].values()) == 6
  assert line["greedy"]["drafted"] > 0 and line["sampled"]["drafted"] == 0


def test_adaptive_draft_needs_speculative_settings():
  with pytest.raises(ValueError, match="max_k >= 1"):
    DraftDepth(max_k=0)
