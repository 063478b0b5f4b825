"""Prefill routing from the engine to the trainer: every position a trained token depends on is recorded, so the
RL step replays the engine's routing everywhere and needs no forward of its own to fill gaps."""
import jax
import numpy as np
import pytest

from composer_jax import model
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import step as rl_step_lib
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from rollout.engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from rollout.trajectory import SegmentBuilder

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        first_k_dense_replace=0, moe_impl="dense", initializer_range=0.2)


def _rows(values):
  return np.asarray([[[v, v + 1]] for v in values], np.int32)   # [T, N=1, K=2]


def test_builder_keeps_first_recorded_routing_and_fills_the_rest_from_prefill():
  b = SegmentBuilder([1, 2, 3])
  # Call 1 (SGLang-style): prompt rows from its prefill, the last output token never fed back (-1).
  b.add_generated([4, 5], [-0.1, -0.2], np.concatenate([_rows([40]), np.full((1, 1, 2), -1, np.int32)]), 0, 0,
                  prompt_routed_PxNxK=_rows([10, 20, 30]))
  b.add_environment([6, 7], 0)                                          # a tool result: no routing yet
  # Call 2 re-reads the whole context: its prefill covers positions 0..6.
  b.add_generated([8], [-0.3], np.full((1, 1, 2), -1, np.int32), 1, 1,
                  prompt_routed_PxNxK=_rows([11, 21, 31, 41, 51, 61, 71]))
  routed = b.build(ends_with_summary=False).routed_TxNxK[:, 0, 0]
  # 0..2 keep call 1's prefill, 3 its decode step; 4 (never fed back in call 1) and 5, 6 come from call 2.
  np.testing.assert_array_equal(routed, [10, 20, 30, 40, 51, 61, 71, -1])
  with pytest.raises(ValueError, match="prompt routing covers 9 positions, the context has 8"):
    b.add_generated([9], [0.0], None, 1, 2, prompt_routed_PxNxK=_rows(range(9)))


def test_result_checks_prompt_routing_layout():
  with pytest.raises(ValueError, match="prompt_routed_experts must be"):
    GenerateResult(np.zeros(1, np.int32), np.zeros(1, np.float32), np.zeros((1, 2, 2), np.int32), 0, "stop",
                   prompt_routed_experts=np.zeros((3, 1, 2), np.int32))


def test_two_turn_jax_engine_context_replays_exactly_without_the_unreplayed_pass():
  params = model.init(jax.random.key(0), CFG)
  engine = JaxEngine(params, CFG, EngineConfig(min_prompt_bucket=16, min_len_bucket=8))
  b = SegmentBuilder([1, 2, 3, 4, 5])
  for turn in range(2):
    req = GenerateRequest(tuple(b.tokens), SamplingParams(temperature=1.0, max_tokens=4, seed=turn))
    res = engine.generate([req])[0]
    b.add_generated(res.output_ids, res.logprobs, res.routed_experts, 0, turn,
                    prompt_routed_PxNxK=res.prompt_routed_experts)
    if turn == 0:
      b.add_environment([7, 8, 9], turn)                                # an observation between the turns
  seg = b.build(ends_with_summary=False)
  traj = {"task_id": "t", "reward": 1.0, "segments": [{"tokens_T": seg.tokens_T, "gen_mask_T": seg.gen_mask_T,
                                                       "logprobs_T": seg.logprobs_T, "routed_TxNxK": seg.routed_TxNxK}]}
  lm = CFG.num_hidden_layers - CFG.first_k_dense_replace
  batch = rl_batch.make_batch([[traj]], rl_batch.BatchConfig(rows=1, length=24, n_moe_layers=lm, top_k=2))
  needed = np.asarray(rl_step_lib.routing_needed(batch))
  assert needed.sum() == len(seg.tokens_T) - 1 and (batch["routing"][:, needed] >= 0).all()
  m = jax.jit(lambda p, bt: rl_step_lib.rl_loss_fn(p, bt, p, model_cfg=CFG, rl_cfg=rl_step_lib.RLConfig(),
                                                   measure_unreplayed=False)[1][0])(params, batch)
  assert np.isnan(float(m["logprob_gap_no_replay"]))                    # nothing to fill: pass 2 skipped
  # The trainer reproduces the engine's logprobs of both turns (f32 both sides; ~1e-6 seen).
  assert float(m["logprob_gap_replay"]) < 1e-4, float(m["logprob_gap_replay"])
