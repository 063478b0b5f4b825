"""A tree group's shared prefixes stored once (`BatchConfig.share_prefix`): the layout by hand, each branch's hidden
states equal its own row's, and the step's loss, metrics and gradients equal those of the duplicated rows."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import losses
from composer_jax.rl import step as rl_step_lib
from tests import tree_testlib as tl
from tests.test_tree import NODES, REWARDS
from tests.test_tree_batch import CFG, LM, _summary_tree

SHARED = rl_batch.BatchConfig(rows=6, length=16, n_moe_layers=LM, top_k=2, share_prefix=True)


def test_layout_by_hand():
  """prompt · A · A0 | A1 | B · B0 | B1 in one row: each leaf stores only what follows the prefix it shares."""
  b = rl_batch.make_batch([tl.tree_group(NODES, REWARDS, n_layers=LM)], SHARED)
  P = list(tl.PROMPT)
  np.testing.assert_array_equal(b["tokens"][0, :13], P + [1, 2, 3, 60, 4, 5, 6, 7, 8, 9])
  assert b["segment_ids"][0, :14].tolist() == [1] * 13 + [0] and not b["segment_ids"][1:].any()
  assert b["positions"][0, :13].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 3, 4, 4, 5]
  assert b["prev"][0, :13].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 4, 2, 9, 9, 11]
  assert b["branch"][0, :13].tolist() == [0] * 8 + [1, 2, 2, 3, 3]
  # The prompt is in all four leaves' streams, A in A0's and A1's, B in B0's and B1's.
  assert b["branch_end"][0, :13].tolist() == [4, 4, 4, 2, 2, 1, 1, 1, 2, 4, 3, 4, 4]
  assert b["seq"][0, :13].tolist() == [0] * 8 + [1, 2, 2, 3, 3]
  # Each generated token trained once, with its leaf count and its node's advantage.
  assert b["gen_mask"][0, :13].tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]
  assert b["loss_weight"][0, 3:13].tolist() == [2, 2, 1, 1, 1, 1, 2, 1, 1, 1]
  np.testing.assert_array_equal(b["token_adv"][0, 3:13], [-0.25, -0.25, 0.5, 0.5, 0.5, -0.5, 0.25, 0, 0, 0])
  assert b["first"].tolist()[:4] == [1, 1, 1, 1] and b["valid"].sum() == 4
  # Routing and logprobs of a shared token come from the copy stored (they are functions of token and position).
  np.testing.assert_array_equal(b["routing"][:, 0, 11], tl.segment(P + [6, 8, 9], LM)["routed_TxNxK"][4].T)
  # 13 tokens where the duplicated rows take 8 + 6 + 5 + 6.
  assert rl_batch.segment_lengths(tl.tree_group(NODES, REWARDS), SHARED) == [13]
  assert rl_batch.segment_lengths(tl.tree_group(NODES, REWARDS)) == [8, 6, 5, 6]


def test_a_piece_is_cut_at_the_row_length():
  """At length 12 the fourth leaf does not fit: it starts a piece of its own with its whole stream."""
  cfg = dataclasses.replace(SHARED, length=12)
  group = tl.tree_group(NODES, REWARDS)
  assert rl_batch.segment_lengths(group, cfg) == [11, 6]
  b = rl_batch.make_batch([group], cfg)
  np.testing.assert_array_equal(b["tokens"][1, :6], list(tl.PROMPT) + [6, 8, 9])
  assert b["gen_mask"][1, :6].tolist() == [0, 0, 0, 0, 1, 1]   # B's token 6 is trained in the first piece
  assert b["branch_end"][1, :6].tolist() == [1] * 6


def _params(cfg):
  return model.init(jax.random.key(0), cfg), model.init(jax.random.key(7), cfg)


@pytest.mark.parametrize("kernel", ["whole", "tiled"])
def test_each_branch_sees_its_own_stream(kernel):
  """Hidden states of a shared row at each leaf's tokens = those of the leaf's own row at the same offsets."""
  cfg = dataclasses.replace(CFG, attention_kernel=kernel)
  params, _ = _params(cfg)
  group = tl.tree_group(NODES, REWARDS, n_layers=LM)
  b = rl_batch.make_batch([group], SHARED)
  h, _ = model.hidden_states(params, jnp.asarray(b["tokens"]), cfg, segment_ids=jnp.asarray(b["segment_ids"]),
                             positions=jnp.asarray(b["positions"]), routing=jnp.asarray(b["routing"]),
                             branches=(jnp.asarray(b["branch"]), jnp.asarray(b["branch_end"])))
  for i, leaf in enumerate(group):
    seg = leaf["segments"][0]
    own, _ = model.hidden_states(params, jnp.asarray(seg["tokens_T"])[None], cfg,
                                 routing=jnp.asarray(seg["routed_TxNxK"]).transpose(1, 0, 2)[:, None])
    at = np.flatnonzero((b["branch"][0] == i) & (b["segment_ids"][0] > 0))
    np.testing.assert_allclose(h[0, at], own[0, b["positions"][0, at]], rtol=1e-5, atol=1e-6)


def _loss_and_grads(params, ref, batch, cfg, rl_cfg):
  fn = jax.value_and_grad(functools.partial(rl_step_lib.rl_loss_fn, model_cfg=cfg, rl_cfg=rl_cfg), has_aux=True)
  (loss, (metrics, _)), grads = jax.jit(fn)(params, {k: jnp.asarray(v) for k, v in batch.items()}, ref)
  return loss, metrics, grads


@pytest.mark.parametrize("routing", ["recorded", "missing"])
def test_loss_metrics_and_gradients_equal_the_duplicated_rows(routing):
  """Two tree groups (one across a self-summary boundary), packed, with the NODES tree cut into two pieces: the
  same numbers as with each leaf's context repeated in its row. With no recorded routing the unreplayed forward
  fills every position a trained token depends on (`routing_needed` over the shared rows)."""
  params, ref = _params(CFG)
  n_layers = LM if routing == "recorded" else 0
  summary = _summary_tree()
  if not n_layers:
    summary = [t | {"segments": [s | {"routed_TxNxK": None} for s in t["segments"]]} for t in summary]
  groups = [tl.tree_group(NODES, REWARDS, n_layers=n_layers), summary]
  dup_cfg = rl_batch.BatchConfig(rows=10, length=12, n_moe_layers=LM, top_k=2, pack_rows=4, is_cap=1.05)
  shared_cfg = dataclasses.replace(dup_cfg, share_prefix=True)
  dup, shared = rl_batch.make_batch(groups, dup_cfg), rl_batch.make_batch(groups, shared_cfg)
  assert (shared["segment_ids"] > 0).sum() < (dup["segment_ids"] > 0).sum()   # fewer tokens stored
  rl_cfg = rl_step_lib.RLConfig(loss=losses.LossConfig(kl_coef=0.1))
  l_d, m_d, g_d = _loss_and_grads(params, ref, dup, CFG, rl_cfg)
  l_s, m_s, g_s = _loss_and_grads(params, ref, shared, CFG, rl_cfg)
  assert 0 < float(m_s["clip_fraction"]) < 1 and float(jnp.abs(l_s)) > 1e-3   # the truncation is exercised
  np.testing.assert_allclose(l_s, l_d, rtol=1e-5)   # f32 sums in another order
  for k in ("kl", "importance_ratio_mean", "importance_ratio_max", "clip_fraction", "logprob_gap", "entropy",
            "generated_tokens", "reward", "pass_rate", "length", "trajectories"):
    np.testing.assert_allclose(m_s[k], m_d[k], rtol=1e-5, atol=1e-7, err_msg=k)
  # The routing mismatch counts each recorded position once (the shared rows hold a prefix's positions once), so
  # it is a different average of the same per-position comparisons.
  assert (float(m_s["routing_mismatch_rate"]) > 0) == (routing == "recorded")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g_s, g_d)


def test_mtp_is_scored_only_where_the_row_continues_the_stream():
  """Targets whose row predecessors (up to the drafter's depth) are not their stream predecessors are dropped."""
  b = rl_batch.make_batch([tl.tree_group(NODES, REWARDS)], SHARED)
  batch = {k: jnp.asarray(v) for k, v in b.items()}
  # Branch starts at row positions 8, 9 and 11 (prev != position - 1): one module drops them and the next token.
  want = b["gen_mask"].copy()
  want[0, [8, 9, 10, 11, 12]] = 0
  np.testing.assert_array_equal(rl_step_lib.mtp_gen_mask(batch, 1), want)
  flat = {k: v for k, v in batch.items() if k not in ("prev", "branch", "branch_end")}
  np.testing.assert_array_equal(rl_step_lib.mtp_gen_mask(flat, 1), b["gen_mask"])


def test_a_tree_model_with_mtp_trains_the_policy_as_the_duplicated_rows():
  cfg = dataclasses.replace(CFG, num_nextn_predict_layers=1)
  params, ref = _params(cfg)
  groups = [tl.tree_group(NODES, REWARDS, n_layers=LM)]
  dup = rl_batch.make_batch(groups, rl_batch.BatchConfig(rows=6, length=12, n_moe_layers=LM, top_k=2))
  shared = rl_batch.make_batch(groups, SHARED)
  rl_cfg = rl_step_lib.RLConfig(loss=losses.LossConfig(kl_coef=0.1))
  _, m_d, _ = _loss_and_grads(params, ref, dup, cfg, rl_cfg)
  _, m_s, _ = _loss_and_grads(params, ref, shared, cfg, rl_cfg)
  np.testing.assert_allclose(m_s["pg_loss"], m_d["pg_loss"], rtol=1e-5)
  assert np.isfinite(float(m_s["mtp_loss"]))


def test_attention_that_takes_segment_ids_refuses_branches():
  b = rl_batch.make_batch([tl.tree_group(NODES, REWARDS)], SHARED)
  args = {k: jnp.asarray(b[k]) for k in ("tokens", "segment_ids", "branch", "branch_end")}
  for cfg in (dataclasses.replace(CFG, attention_kernel="pallas"), dataclasses.replace(CFG, attention_impl="ring")):
    with pytest.raises(ValueError, match="shared prefix stored once need dense attention"):
      model.hidden_states(_params(CFG)[0], args["tokens"], cfg, segment_ids=args["segment_ids"],
                          branches=(args["branch"], args["branch_end"]))
