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
  d.record(2, 8, np.array([2, 3, 5]), None, 0)
  # draft 0 reached 10 times, accepted 8; draft 1 reached 8 times, accepted 5.
  np.testing.assert_allclose(d.acceptance(), [0.8, 5 / 8])
  assert d.tokens_per_step(0) == 1.0
  np.testing.assert_allclose(d.tokens_per_step(1), 1.8)
  np.testing.assert_allclose(d.tokens_per_step(2), 1 + 0.8 + 0.8 * 5 / 8)   # = 1 + (8 + 5) / 10 accepted per step
  # A k = 1 call adds to draft 0 only: 4 row-steps, 1 accepted.
  d.record(1, 8, np.array([3, 1]), None, 0)
  np.testing.assert_allclose(d.acceptance(), [9 / 14, 5 / 8])
  d.new_policy()                                     # halving keeps the rates, weighs new counts double
  np.testing.assert_allclose(d.acceptance(), [9 / 14, 5 / 8])
  d.record(1, 8, np.array([7, 0]), None, 0)
  np.testing.assert_allclose(d.acceptance()[0], 4.5 / 14)


def test_pick_explores_every_depth_then_takes_the_most_tokens_per_second_and_probes():
  d = DraftDepth(max_k=2, probe_every=3)
  assert d.pick(8) == (2, "explore")
  d.record(2, 8, np.array([2, 3, 5]), None, 10)      # compiled: no cost recorded, acceptance counted
  assert d.pick(8) == (2, "explore")
  d.record(2, 8, np.array([2, 3, 5]), 0.030, 10)     # 3 ms/step
  assert d.pick(8) == (0, "explore")
  d.record(0, 8, None, 0.010, 10)                    # 1 ms/step
  assert d.pick(8) == (1, "explore")
  d.record(1, 8, np.array([1, 4]), 0.020, 10)        # 2 ms/step
  # draft 0: 16 + 4 accepted of 20 + 5; draft 1: 10 of 16.
  a0, a1 = 20 / 25, 10 / 16
  np.testing.assert_allclose(d.acceptance(), [a0, a1])
  # tokens/s per row: k=0 1/1ms = 1000; k=1 1.8/2ms = 900; k=2 (1 + .8 + .8·.625)/3ms = 767 -> k = 0.
  assert d.pick(8) == (0, "best")                    # call 5
  assert d.pick(8) == (2, "probe")                   # call 6: every 3rd call runs k = 2
  assert d.chosen == 0
  assert d.pick(4) == (2, "explore")                 # costs are per row bucket
  d.record(0, 8, None, 0.040, 10)                    # plain steps got slower (mean of 1 and 4 ms = 2.5 ms)
  assert d.pick(8) == (1, "best")                    # k=1: (1 + a0) / 2 ms = 900 > 1 / 2.5 ms = 400
  assert "k=1" in d.describe(8) and "acceptance per draft" in d.describe(8)


def test_step_costs_leave_out_the_prefill_so_calls_of_different_turns_compare():
  """Calls timed as p · prefill + d(k) · steps with p = 20 us/token, d = 1.0 / 1.4 / 2.2 ms. The speculative calls
  came on turns with long prefills: seconds per step would rank k = 0 first; the fit recovers d and picks k = 1."""
  d = DraftDepth(max_k=2)
  d.record(2, 16, np.array([2, 3, 5]), None, 10)   # compiled; acceptance a = (0.8, 0.625): E = 1, 1.8, 2.3
  p, cost = 2e-5, {0: 1.0e-3, 1: 1.4e-3, 2: 2.2e-3}
  calls = [(2, 40, 4096), (2, 30, 2048), (0, 100, 512), (0, 80, 256), (1, 60, 3072), (1, 50, 1024)]
  for k, steps, prefill in calls:
    d.record(k, 16, None, p * prefill + cost[k] * steps, steps, prefill)
  np.testing.assert_allclose(d.prefill_cost(16), p, rtol=1e-9)
  for k in cost:
    np.testing.assert_allclose(d.step_cost(k, 16), cost[k], rtol=1e-9)
  per_step = {k: np.mean([(p * f + cost[k] * n) / n for kk, n, f in calls if kk == k]) for k in cost}
  assert min(per_step, key=per_step.get) == 0                 # prefill included, plain decoding looks cheapest
  assert d.pick(16) == (1, "best")                           # 1.8 / 1.4 ms > 2.3 / 2.2 ms > 1 / 1.0 ms
  assert "prefill 20.0 us/token" in d.describe(16)


def test_step_costs_fall_back_to_seconds_per_step_when_the_prefill_cannot_be_separated():
  d = DraftDepth(max_k=1)
  d.record(0, 8, None, 0.020, 10, 100)   # every call prefills 10 tokens per step: prefill and steps are collinear
  d.record(0, 8, None, 0.040, 20, 200)
  d.record(1, 8, np.array([1, 1]), 0.030, 10, 100)
  assert d.prefill_cost(8) == 0.0
  np.testing.assert_allclose([d.step_cost(0, 8), d.step_cost(1, 8)], [2e-3, 3e-3])


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
  assert ks[:4] == [1, 1, 0, 0]                      # explored (each k's first call compiles, its second is timed)
  assert ks[5] == 1 or ks[4] == 1                    # k = 1 is chosen or probed (every 2nd call) afterwards
  assert any(line.startswith("engine e: draft depth k=") for line in logged)
  eng.update_weights(params, policy_version=1)       # the served version's line is written
  (line,) = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
  assert line["version"] == 0 and line["calls"] == 6 and sum(line["k_calls"].values()) == 6
  assert line["greedy"]["drafted"] > 0 and line["sampled"]["drafted"] == 0


def test_adaptive_draft_needs_speculative_settings():
  with pytest.raises(ValueError, match="max_k >= 1"):
    DraftDepth(max_k=0)
