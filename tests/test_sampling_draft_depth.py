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
  d.record([(2, np.array([2, 3, 5]), 30, None)])
  # draft 0 reached 10 times, accepted 8; draft 1 reached 8 times, accepted 5.
  np.testing.assert_allclose(d.acceptance(), [0.8, 5 / 8])
  assert d.tokens_per_step(0) == 1.0
  np.testing.assert_allclose(d.tokens_per_step(1), 1.8)
  np.testing.assert_allclose(d.tokens_per_step(2), 1 + 0.8 + 0.8 * 5 / 8)   # = 1 + (8 + 5) / 10 accepted per step
  # A k = 1 run adds to draft 0 only: 4 row-steps, 1 accepted.
  d.record([(1, np.array([3, 1]), 5, None), (0, None, 5, None)])
  np.testing.assert_allclose(d.acceptance(), [9 / 14, 5 / 8])
  d.new_policy()                                     # halving keeps the rates, weighs new counts double
  np.testing.assert_allclose(d.acceptance(), [9 / 14, 5 / 8])
  d.record([(1, np.array([7, 0]), 7, None)])
  np.testing.assert_allclose(d.acceptance()[0], 4.5 / 14)


def _runs(ks, seconds, tokens=100):
  return [(k, None, tokens, seconds[k]) for k in ks]


def test_explores_every_depth_on_paired_calls_then_takes_the_most_tokens_per_second():
  d = DraftDepth(max_k=2, explore_calls=3)
  # Explore: every call decodes with every k, the returned one (first) in turn; a run just compiled is untimed.
  ks, why = d.pick(lambda k: False)
  assert (ks, why) == ([1, 2, 0], "explore")
  d.record([(1, None, 100, None), (2, None, 100, None), (0, None, 100, None)])   # all compiled: no pair
  assert not d.settle() and d.chosen is None
  ks, _ = d.pick(lambda k: True)
  assert ks == [2, 0, 1]
  d.record(_runs(ks, {0: 1.0, 1: 0.5, 2: 0.8}))      # 100 tokens each: 100, 200, 125 tokens/s
  assert not d.settle()                              # 2 of 3 exploring calls
  ks, _ = d.pick(lambda k: True)
  assert ks == [0, 1, 2]
  d.record([(0, None, 300, 2.0), (1, None, 240, 1.0), (2, None, 200, 1.0)])
  # Pooled over both timed calls: k=0 400 / 3.0 s, k=1 340 / 1.5 s, k=2 300 / 1.8 s -> k = 1 (against k = 2: 1.36).
  np.testing.assert_allclose(d.rate(1, 2), (340 / 1.5, 300 / 1.8))
  np.testing.assert_allclose(d.relative_rate(0, 2), (400 / 3.0) / (300 / 1.8))
  assert d.settle() and d.chosen == 1
  assert "k=0: 1.00 tok/step, 133 tok/s vs 227 for k=1" in d.describe()


def test_probes_pair_the_chosen_depth_with_a_compiled_one_and_switch_with_hysteresis():
  d = DraftDepth(max_k=2, probe_every=2, explore_calls=1, window=4, margin=0.1)
  d.pick(lambda k: True)
  d.record(_runs([1, 2, 0], {0: 1.0, 1: 0.5, 2: 0.8}))
  assert d.settle() and d.chosen == 1
  only_chosen = lambda k: k == 1                     # noqa: E731  a shape where only the chosen k is compiled
  # Such a shape never probes (a probe there would compile); where the others exist every 2nd call probes, paired
  # with the chosen k (first: its output is returned), the others in turn.
  assert [d.pick(only_chosen) for _ in range(3)] == [([1], "best")] * 3
  assert [d.pick(lambda k: True) for _ in range(4)] == [([1], "best"), ([1, 2], "probe"), ([1], "best"),
                                                        ([1, 0], "probe")]
  # k = 2 gets 5% faster than k = 1 on the last 4 paired calls (the window): within the margin, no switch.
  for _ in range(4):
    d.record(_runs([1, 2], {1: 1.05, 2: 1.0}))
  np.testing.assert_allclose(d.relative_rate(2, 1), 1.05)
  assert not d.settle() and d.chosen == 1
  # 20% faster: switch.
  for _ in range(4):
    d.record(_runs([1, 2], {1: 1.2, 2: 1.0}))
  assert d.settle() and d.chosen == 2


def test_a_depth_never_timed_beside_another_leaves_the_largest():
  d = DraftDepth(max_k=2, explore_calls=1)
  d.pick(lambda k: False)
  d.record([(k, None, 100, None) for k in (1, 2, 0)])
  assert d.settle() and d.chosen == 2


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
                                                   draft_probe_every=2, draft_explore_calls=2),
                  stats_path=str(tmp_path / "e.jsonl"), name="e", log_fn=logged.append)
  ks = []
  for _ in range(6):
    for a, b in zip(plain, eng.generate(reqs)):
      np.testing.assert_array_equal(a.output_ids, b.output_ids)
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    ks.append(eng.last_stats["draft_tokens"])
  # Calls 1-2 decode their prefill with both k, returning k = 1's output, then k = 0's; then the choice runs, and
  # every 2nd call also decodes with the other k (compiled for this shape by the exploration).
  assert ks[:2] == [1, 0] and eng.depth.probes == 2  # calls 4 and 6 probed
  assert eng.compiles == 3                           # one prefill program for both k, one decode program per k
  assert eng.last_stats["compiles"] == 0 and eng.last_stats["decode_s"] > 0
  assert any(line.startswith("engine e: draft depth k=") for line in logged)
  eng.update_weights(params, policy_version=1)       # the served version's line is written
  (line,) = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
  assert line["version"] == 0 and line["calls"] == 6 and sum(line["k_calls"].values()) == 6
  assert line["greedy"]["drafted"] > 0 and line["sampled"]["drafted"] == 0


def test_adaptive_draft_needs_speculative_settings():
  with pytest.raises(ValueError, match="max_k, probe_every and explore_calls >= 1"):
    DraftDepth(max_k=0)
