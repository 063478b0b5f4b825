"""Packed RL batches (`rl.pack_rows`): the layout, the packer, step assembly, and the step's loss and gradients
against the unpacked batch of the same groups (the reference)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import configs, model
from composer_jax.model.config import ModelConfig
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import sources
from composer_jax.rl import step as rl_step_lib
from composer_jax.rl.config import RunConfig
from rollout.queue import QueueConsumer, QueueProducer
from rollout.staleness import StalenessConfig

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                  n_shared_experts=1, first_k_dense_replace=0, moe_impl="dense", num_nextn_predict_layers=0,
                  max_position_embeddings=64)
LM = CFG.num_hidden_layers


def _seg(T, prompt, seed, routed=True):
  rng = np.random.default_rng(seed)
  gen = (np.arange(T) >= prompt).astype(np.int8)
  return {"tokens_T": rng.integers(1, CFG.vocab_size, T).astype(np.int32), "gen_mask_T": gen,
          "logprobs_T": np.where(gen, -rng.uniform(0.1, 3.0, T), 0.0).astype(np.float32),
          "routed_TxNxK": rng.integers(0, 4, (T, LM, 2)).astype(np.int32) if routed else None}


def _traj(lengths, reward, seed):
  return {"task_id": f"t{seed}", "reward": reward, "metrics": {"solved": float(reward > 0)},
          "segments": [_seg(T, 3, seed * 10 + i) for i, T in enumerate(lengths)]}


def test_packer_first_fit_longest_first_all_or_nothing():
  p = rl_batch.Packer(n_rows=2, length=10, max_sequences=5)
  assert p.add([3, 6]) == [(0, 6), (0, 0)]            # the 6 first, then the 3 in the same row
  assert p.add([2, 5]) == [(1, 5), (1, 0)]            # row 0 has 1 left: both go to row 1
  assert p.add([1, 4]) is None and p.free == [1, 3]   # the 4 fits nowhere: nothing placed
  assert p.add([1]) == [(0, 9)]
  assert p.add([1]) is None                           # a sixth sequence: over max_sequences
  with pytest.raises(ValueError, match="pack_rows <= rows"):
    rl_batch.BatchConfig(rows=2, length=4, n_moe_layers=0, top_k=1, pack_rows=3)


def test_packed_layout():
  a, b = _traj([5, 4], 1.0, 0), _traj([6], 0.0, 1)     # a two-segment chain and a one-segment trajectory
  c = _traj([3], 0.5, 2)
  cfg = rl_batch.BatchConfig(rows=6, length=10, n_moe_layers=LM, top_k=2, pack_rows=2, stale_is_cap=1.5)
  out = rl_batch.make_batch([[a, b], [c]], cfg, staleness=[0, 3], over_stale=[False, True])
  assert out["tokens"].shape == (2, 10) and out["reward"].shape == (6,)
  # group 0 longest first: b (6) row 0; a's 5 row 1; a's 4 fills row 0; group 1: c (3) row 1 after a's 5
  np.testing.assert_array_equal(out["seq"][0], [2] * 6 + [1] * 4)
  np.testing.assert_array_equal(out["seq"][1], [0] * 5 + [3] * 3 + [0, 0])
  np.testing.assert_array_equal(out["segment_ids"][0], [1] * 6 + [2] * 4)
  np.testing.assert_array_equal(out["segment_ids"][1], [1] * 5 + [2] * 3 + [0, 0])
  np.testing.assert_array_equal(out["positions"][0], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
  np.testing.assert_array_equal(out["tokens"][0, 6:], a["segments"][1]["tokens_T"])
  np.testing.assert_array_equal(out["routing"][:, 1, 5:8], c["segments"][0]["routed_TxNxK"].transpose(1, 0, 2))
  np.testing.assert_array_equal(out["routing"][:, 1, 8:], -1)
  # each sequence's first token is never trained (its context would be the row's previous sequence)
  np.testing.assert_array_equal(out["gen_mask"][0], [0, 0, 0, 1, 1, 1, 0, 0, 0, 1])
  np.testing.assert_array_equal(out["gen_mask"][1], [0, 0, 0, 1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(out["first"], [1, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(out["group"][:4], [0, 0, 0, 1])
  np.testing.assert_array_equal(out["valid"], [1, 1, 1, 1, 0, 0])
  np.testing.assert_allclose(out["is_cap"][:4], [2.0, 2.0, 2.0, 1.5])
  np.testing.assert_array_equal(out["traj_gen_tokens"][:4], [3, 3, 3, 0])


def test_a_group_too_large_to_pack_gets_the_unpacked_shape():
  big = [_traj([9], 1.0, i) for i in range(3)]           # three 9-token sequences: one per 10-token row
  cfg = rl_batch.BatchConfig(rows=4, length=10, n_moe_layers=0, top_k=1, pack_rows=2)
  out = rl_batch.make_batch([big], cfg)
  assert out["tokens"].shape == (4, 10)                  # rows = S
  np.testing.assert_array_equal(out["seq"][:3, 0], [0, 1, 2])


def _batches(normalize_rows=6):
  groups = [[_traj([7, 5], 1.0, 0), _traj([6], 0.0, 1), _traj([4, 4], 0.5, 2)],
            [_traj([8], 1.0, 3), _traj([5], 0.0, 4)]]
  kw = dict(rows=normalize_rows + 2, length=12, n_moe_layers=LM, top_k=2)
  unpacked = rl_batch.make_batch(groups, rl_batch.BatchConfig(**kw), staleness=[0, 1])
  packed = rl_batch.make_batch(groups, rl_batch.BatchConfig(**kw, pack_rows=4), staleness=[0, 1])
  assert packed["tokens"].shape == (4, 12) and unpacked["tokens"].shape == (8, 12)
  return ({k: jnp.asarray(v) for k, v in unpacked.items()}, {k: jnp.asarray(v) for k, v in packed.items()})


@pytest.mark.parametrize("normalize", ["tokens", "sequence"])
def test_packed_step_matches_unpacked_loss_metrics_and_gradients(normalize):
  params = model.init(jax.random.key(0), CFG)
  ref = model.init(jax.random.key(1), CFG)
  unpacked, packed = _batches()
  rl_cfg = rl_step_lib.RLConfig(loss=rl_step_lib.losses.LossConfig(normalize=normalize, kl_coef=0.1))

  @jax.jit
  def run(p, b):
    return jax.value_and_grad(lambda p: rl_step_lib.rl_loss_fn(p, b, ref, model_cfg=CFG, rl_cfg=rl_cfg,
                                                               measure_unreplayed=True), has_aux=True)(p)
  (l_u, (m_u, _)), g_u = run(params, unpacked)
  (l_p, (m_p, _)), g_p = run(params, packed)
  np.testing.assert_allclose(l_p, l_u, rtol=1e-5, atol=1e-7)
  for k in ("kl", "entropy", "logprob_gap_replay", "logprob_gap_no_replay", "importance_ratio_mean",
            "generated_tokens", "reward", "pass_rate", "length", "advantage_abs_mean", "routing_mismatch_rate"):
    np.testing.assert_allclose(m_p[k], m_u[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert float(m_u["generated_tokens"]) == sum(T - 3 for T in (7, 5, 6, 4, 4, 8, 5))
  for gp, gu in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_u)):
    np.testing.assert_allclose(gp, gu, rtol=2e-4, atol=1e-6)
  assert float(jnp.max(jnp.abs(jax.tree.leaves(g_u)[0]))) > 0


def test_routing_needed_per_packed_sequence():
  _, packed = _batches()
  got = np.asarray(rl_step_lib.routing_needed(packed))
  gen, seq, seg = (np.asarray(packed[k]) for k in ("gen_mask", "seq", "segment_ids"))
  want = np.zeros_like(got)
  for s in np.unique(seq[seg > 0]):
    r, cols = np.nonzero((seq == s) & (seg > 0))
    last = cols[gen[r, cols] > 0].max()
    want[r[0], cols[cols < last]] = True
  np.testing.assert_array_equal(got, want)


def test_take_groups_packs_until_the_next_group_does_not(tmp_path):
  """Packed steps: whole groups while they pack into pack_rows rows; the one that does not opens the next step,
  and a group too large to pack alone gets a step of its own (unpacked shape), never an error or a stall."""
  cfg = configs.replace(RunConfig(model=ModelConfig(vocab_size=512), workdir=str(tmp_path)),
                        **{"rl.groups_per_step": 4, "rollout.samples_per_prompt": 2, "harness.context_budget": 320,
                           "harness.max_segments": 2, "rl.rows_per_step": 8, "rl.pack_rows": 2,
                           "harness.max_turn_tokens": 48, "harness.observation_reserve": 64})
  url = f"file://{tmp_path}/q"
  producer = QueueProducer(url, "w")
  queued = [[150], [150], [200], [300], [60], [60], [300, 300], [60]]   # each: a group of two such trajectories
  for i, lengths in enumerate(queued):
    producer.append_group([_traj(lengths, 1.0, 2 * i), _traj(lengths, 0.0, 2 * i + 1)], policy_version=0, i=i)
  consumer = QueueConsumer(url, StalenessConfig(max_staleness=5))
  bcfg = rl_batch.BatchConfig(rows=8, length=320, n_moe_layers=0, top_k=1, pack_rows=2)
  steps, shapes = [], []
  for _ in range(5):
    step = sources.take_groups(consumer, cfg, 0)
    steps.append([g.tree()["meta"]["i"] for g in step])
    shapes.append(rl_batch.from_consumed(step, bcfg)["tokens"].shape[0])   # every step builds
  # two 320-token rows: 150+150 twice fill them; 200 and 300 pair with nothing; 60+60; the 300+300 chains (four
  # sequences of 300) are too large for two rows: a step of their own (8 rows), which the last 60 does not join
  assert steps == [[0, 1], [2], [3], [4, 5], [6]]
  assert shapes == [2, 2, 2, 2, 8]
  assert consumer.depth() == (1, 2)                        # the last group waits for the next step


def test_pack_rows_config_errors():
  base = RunConfig(model=ModelConfig(vocab_size=512), workdir="/tmp/unused")
  with pytest.raises(ValueError, match="pack_rows=-1"):
    configs.replace(base, **{"rl.pack_rows": -1})
  with pytest.raises(ValueError, match="set it <= 32"):
    configs.replace(base, **{"rl.pack_rows": 33})
