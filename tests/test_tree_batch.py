"""Training on tree groups: the batch trains each shared token once with its leaf count, the step's loss and
gradients equal those of the leaves unrolled into flat rows, and the flat path is unchanged."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import losses, placement
from composer_jax.rl import step as rl_step_lib
from rollout import tree as tree_lib
from rollout.queue import QueueConsumer, QueueProducer, open_store
from rollout.staleness import StalenessConfig
from tests import tree_testlib as tl
from tests.test_tree import NODES, REWARDS

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        first_k_dense_replace=0, moe_impl="dense")
LM, K = 2, 2
BCFG = rl_batch.BatchConfig(rows=6, length=12, n_moe_layers=LM, top_k=K)


def test_tree_batch_layout():
  b = rl_batch.make_batch([tl.tree_group(NODES, REWARDS, n_layers=LM)], BCFG)
  # Row 0 = leaf A0 trains node A (weight 2, advantage -1/4) and itself; row 1 = A1 trains only its own token.
  np.testing.assert_array_equal(b["gen_mask"][:4, :8], [[0, 0, 0, 1, 1, 1, 0, 1], [0, 0, 0, 0, 0, 1, 0, 0],
                                                        [0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0]])
  np.testing.assert_array_equal(b["loss_weight"][0, 3:8], [2, 2, 1, 1, 1])
  np.testing.assert_array_equal(b["token_adv"][0, 3:8], [-0.25, -0.25, 0.5, 0.5, 0.5])
  np.testing.assert_array_equal(b["token_adv"][1, 5], -0.5)
  np.testing.assert_array_equal(b["first"], [1, 1, 1, 1, 0, 0])
  # A flat batch is unchanged: no tree fields, the trajectories' own generated tokens as the loss mask.
  flat = rl_batch.make_batch([tl.flat_group([[1, 2], [3]], [1.0, 0.0])], BCFG)
  assert "token_adv" not in flat and "loss_weight" not in flat
  np.testing.assert_array_equal(flat["gen_mask"][:2, :5], [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]])


def _summary_tree():
  """Three leaves sharing segment 0 (ending in a summary) and segment 1 up to the branch point."""
  seg0 = list(tl.PROMPT) + [1, 2, 60, 3, 4]
  leaves = []
  for j, (tail, r) in enumerate([([5, 6], 1.0), ([7], 0.0), ([8], 0.5)]):
    leaves.append({"task_id": "t", "reward": r, "metrics": {},
                   "segments": [tl.segment(seg0, LM), tl.segment(list(tl.PROMPT) + [55, 56, 9] + tail, LM)],
                   "tree": {"path": [0, j], "starts": [[0, 3], [1, 6]], "multiplicity": 1}})
  return leaves


def test_a_shared_segment_is_stored_once():
  group = _summary_tree()
  assert tree_lib.group_rows(group) == [(0, 0), (0, 1), (1, 1), (2, 1)]
  assert rl_batch.segment_lengths(group) == [8, 8, 7, 7]
  for cfg in (BCFG, dataclasses.replace(BCFG, pack_rows=3, length=16)):
    b = rl_batch.make_batch([group], cfg)
    assert b["valid"].sum() == 4 and b["first"].tolist()[:4] == [1, 0, 1, 1]
    # Generated tokens trained: segment 0's four and token 9 once (weight 3), then each leaf's own tail.
    np.testing.assert_array_equal(np.sort(b["loss_weight"][b["gen_mask"] > 0]), [1] * 4 + [3] * 5)


def _unrolled(groups, cfg):
  """The same leaves as flat rows: every leaf trains all its generated tokens with its nodes' advantages."""
  flat = [[{k: v for k, v in t.items() if k != "tree"} for t in g] for g in groups]
  b = rl_batch.make_batch(flat, cfg)
  adv = np.zeros_like(b["gen_mask"])
  i = 0
  for g in groups:
    for leaf in tree_lib.token_credit(g):
      for row in leaf:
        adv[i, :len(row["advantage_T"])] = row["advantage_T"]
        i += 1
  return b | {"token_adv": adv, "loss_weight": np.ones_like(adv)}


@pytest.fixture(scope="module")
def params():
  return model.init(jax.random.key(0), CFG), model.init(jax.random.key(7), CFG)


@pytest.mark.parametrize("normalize", ["tokens", "constant"])
def test_tree_loss_and_gradients_equal_the_unrolled_leaves(params, normalize):
  """The step on a tree batch (shared tokens once, weighted) = on its leaves unrolled (shared tokens repeated):
  loss, gradients, KL penalty, truncated importance weights and replayed routing included."""
  p, ref = params
  groups = [tl.tree_group(NODES, REWARDS, n_layers=LM), _summary_tree()]
  cfg = dataclasses.replace(BCFG, rows=10, length=12, is_cap=1.05)
  tree_b, unrolled_b = rl_batch.make_batch(groups, cfg), _unrolled(groups, cfg)
  assert tree_b["gen_mask"].sum() < unrolled_b["gen_mask"].sum()
  rl_cfg = rl_step_lib.RLConfig(loss=losses.LossConfig(kl_coef=0.1, normalize=normalize, norm_constant=50.0))
  fn = jax.jit(jax.value_and_grad(functools.partial(rl_step_lib.rl_loss_fn, model_cfg=CFG, rl_cfg=rl_cfg),
                                  has_aux=True))
  (l_t, (m_t, _)), g_t = fn(p, {k: jnp.asarray(v) for k, v in tree_b.items()}, ref)
  (l_u, (m_u, _)), g_u = fn(p, {k: jnp.asarray(v) for k, v in unrolled_b.items()}, ref)
  assert 0 < float(m_t["clip_fraction"]) < 1 and float(m_t["routing_mismatch_rate"]) > 0   # both paths exercised
  np.testing.assert_allclose(l_t, l_u, rtol=1e-5)      # f32 sums in a different order
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g_t, g_u)
  assert float(jnp.abs(l_t)) > 1e-3


def test_flat_path_is_bit_identical_with_unit_weights():
  """`policy_loss` with no weights is the old formula; unit weights give the same bits (values and gradients)."""
  rng = np.random.default_rng(0)
  lp, inf, ref = (jnp.asarray(rng.normal(size=(3, 7)) - 2, jnp.float32) for _ in range(3))
  mask = jnp.asarray(rng.integers(0, 2, (3, 7)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=3), jnp.float32)
  for normalize in ("tokens", "constant"):
    cfg = losses.LossConfig(kl_coef=0.1, normalize=normalize)
    f = lambda x, w, cfg=cfg: losses.policy_loss(x, inf, ref, adv, mask, jnp.full(3, 2.0), cfg, weight_BxL=w)[0]
    v0, g0 = jax.value_and_grad(f)(lp, None)
    v1, g1 = jax.value_and_grad(f)(lp, jnp.ones((3, 7)))
    np.testing.assert_array_equal(v0, v1)
    np.testing.assert_array_equal(g0, g1)
    # The unweighted 'tokens' loss, written out: Σ −min(ρ, c)(A − β k1) / n.
    if normalize == "tokens":
      w = jnp.minimum(jnp.exp(lp - inf), 2.0)
      np.testing.assert_allclose(v0, jnp.sum(-w * (adv[:, None] - 0.1 * (lp - ref)) * mask) / mask.sum(), rtol=1e-6)


def test_flat_tree_gives_group_advantages_per_token():
  rewards = [1.0, 0.0, 0.5, 0.5]
  group = tl.flat_group([[1, 2], [3], [4, 5, 6], [7]], rewards)
  as_tree = [t | {"tree": {"path": [i], "starts": [[0, 0]], "multiplicity": 1}} for i, t in enumerate(group)]
  flat, tree = rl_batch.make_batch([group], BCFG), rl_batch.make_batch([as_tree], BCFG)
  for k in flat:
    np.testing.assert_array_equal(flat[k], tree[k], err_msg=k)
  adv = losses.group_advantages(flat["reward"], flat["group"], flat["first"], flat["valid"])
  np.testing.assert_array_equal(tree["token_adv"] * tree["gen_mask"], np.asarray(adv)[flat["seq"]] * flat["gen_mask"])
  np.testing.assert_array_equal(tree["loss_weight"][tree["gen_mask"] > 0], 1.0)


def test_tree_options_that_do_not_apply_fail_clearly(params):
  p, ref = params
  b = {k: jnp.asarray(v) for k, v in rl_batch.make_batch([tl.tree_group(NODES, REWARDS, n_layers=LM)], BCFG).items()}
  for loss_cfg, match in [(losses.LossConfig(adv_std=True), "adv_std is not available for tree groups"),
                          (losses.LossConfig(normalize="sequence"), "'sequence' .* not defined for tree groups")]:
    with pytest.raises(ValueError, match=match):
      rl_step_lib.rl_loss_fn(p, b, ref, model_cfg=CFG, rl_cfg=rl_step_lib.RLConfig(loss=loss_cfg))


def test_tree_group_round_trips_the_queue():
  group = _summary_tree()
  kv = open_store("memory://")
  QueueProducer(kv, "w0").append_group(group, policy_version=0)
  (got,) = QueueConsumer(kv, StalenessConfig(max_staleness=1)).poll(0, max_rows=4)
  direct, via_queue = rl_batch.make_batch([group], BCFG), rl_batch.from_consumed([got], BCFG)
  for k in direct:
    np.testing.assert_array_equal(direct[k], via_queue[k], err_msg=k)


@pytest.mark.slow   # ~95 s here each: two compiles of the step, one on 8 fake devices
@pytest.mark.parametrize("share_prefix", [False, True])
def test_sharded_tree_step_equals_unsharded(params, share_prefix):
  """The tree fields shard like the other per-token fields (rows over the 8 fake devices): same loss and grads.
  With the shared prefix stored once (`branch`, `branch_end`, `prev` too) the tree's four leaves take two rows."""
  p, ref = params
  cfg = dataclasses.replace(BCFG, rows=8, share_prefix=share_prefix)
  batch = {k: jnp.asarray(v) for k, v in rl_batch.make_batch([tl.tree_group(NODES, REWARDS, n_layers=LM)],
                                                             cfg).items()}
  fn = jax.value_and_grad(functools.partial(rl_step_lib.rl_loss_fn, model_cfg=CFG, rl_cfg=rl_step_lib.RLConfig()),
                          has_aux=True)
  (want, _), g_want = jax.jit(fn)(p, batch, ref)
  mesh = mesh_lib.make_mesh({"data": -1})
  bsh, psh = placement.batch_shardings(mesh, trees=True, share_prefix=share_prefix), model.shardings(CFG, mesh)
  assert bsh["token_adv"] == bsh["loss_weight"] == bsh["gen_mask"]
  assert set(bsh) == set(batch) and (share_prefix == ("prev" in batch))
  (got, _), g_got = jax.jit(fn, in_shardings=(psh, bsh, psh))(jax.device_put(p, psh), jax.device_put(batch, bsh),
                                                             jax.device_put(ref, psh))
  np.testing.assert_allclose(got, want, rtol=1e-5)    # f32 sums split across devices
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g_got, g_want)
