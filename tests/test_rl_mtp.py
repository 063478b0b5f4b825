"""The MTP drafter in the RL step: self-distillation loss and acceptance metrics against hand-computed values, and
where its gradient goes (stopped: the trunk's gradient is the one without MTP; through: it changes)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.rl import losses
from composer_jax.rl import step as rl_step_lib
from composer_jax.train import optim
from composer_jax.train.config import OptimConfig

LN = np.log


def test_draft_acceptance_hand_computed():
  # Identity head (D = V = 2): hiddens are logits. p = (1/4, 3/4), q = (3/4, 1/4): Σ min = 1/4 + 1/4 = 1/2.
  # At T = 2 the logits halve: p ∝ (1, √3), q ∝ (√3, 1): Σ min = 2 / (1 + √3).
  teacher = jnp.asarray([[[0.0, LN(3)]]], jnp.float32)
  student = jnp.asarray([[[LN(3), 0.0]]], jnp.float32)
  eye = jnp.eye(2)
  np.testing.assert_allclose(losses.draft_acceptance(student, eye, teacher, eye), [[0.5]], rtol=1e-6)
  np.testing.assert_allclose(losses.draft_acceptance(student, eye, teacher, eye, 2.0), [[2 / (1 + np.sqrt(3))]],
                             rtol=1e-6)
  np.testing.assert_allclose(losses.draft_acceptance(teacher, eye, teacher, eye), [[1.0]], rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 3, 512])
def test_draft_acceptance_matches_its_reference(chunk_size):
  k = jax.random.split(jax.random.key(0), 4)
  h, th = jax.random.normal(k[0], (2, 5, 8)), jax.random.normal(k[1], (2, 5, 8))
  w, tw = jax.random.normal(k[2], (8, 11)), jax.random.normal(k[3], (8, 11))
  for t in (1.0, 0.7):
    np.testing.assert_allclose(losses.draft_acceptance(h, w, th, tw, t, chunk_size=chunk_size),
                               losses.draft_acceptance_reference(h, w, th, tw, t), rtol=1e-5)


def test_mtp_self_distill_hand_computed():
  # B = 1, L = 4, V = 2, identity head; generated tokens at t = 2, 3, so module 0 counts positions t = 0, 1
  # (it predicts token t + 2 from the policy's distribution at t + 1).
  #   t = 0: p = softmax(h[1]) = (1/4, 3/4), q = softmax(g[0]) = (3/4, 1/4): CE −(1/4 ln 3/4 + 3/4 ln 1/4),
  #          argmax differ, Σ min = 1/2
  #   t = 1: p = softmax(h[2]) = (1/2, 1/2), q = (1/2, 1/2): CE ln 2, argmax agree (both 0), Σ min = 1
  # Positions 2, 3 (targets past the end) and every generated-mask-0 target are not counted.
  h = jnp.asarray([[[5.0, 0.0], [0.0, LN(3)], [0.0, 0.0], [9.0, 0.0]]], jnp.float32)
  g = jnp.asarray([[[[LN(3), 0.0], [0.0, 0.0], [0.0, 7.0], [0.0, 7.0]]]], jnp.float32)
  tokens, seg = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
  gen = jnp.asarray([[0, 0, 1, 1]], jnp.float32)
  loss, m = losses.mtp_self_distill(h, g, jnp.eye(2), jnp.eye(2), tokens, seg, gen)
  ce0 = -(0.25 * LN(0.75) + 0.75 * LN(0.25))
  np.testing.assert_allclose(loss, (ce0 + LN(2)) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["mtp_loss"], loss)
  np.testing.assert_allclose(m["mtp_agreement"], 0.5)
  np.testing.assert_allclose(m["mtp_acceptance"], 0.75, rtol=1e-6)
  # A generated token at t = 2 only: module 0 counts position 0 alone.
  _, m = losses.mtp_self_distill(h, g, jnp.eye(2), jnp.eye(2), tokens, seg, jnp.asarray([[0, 0, 1, 0]], jnp.float32))
  np.testing.assert_allclose(m["mtp_acceptance"], 0.5, rtol=1e-6)


CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        first_k_dense_replace=0, moe_impl="dense", num_nextn_predict_layers=1)
B, L, PROMPT = 4, 10, 3


def _batch():
  tokens = jax.random.randint(jax.random.key(1), (B, L), 0, CFG.vocab_size)
  gen = (jnp.arange(L) >= PROMPT).astype(jnp.float32)
  return {"tokens": tokens, "segment_ids": jnp.ones((B, L), jnp.int32),
          "positions": jnp.broadcast_to(jnp.arange(L), (B, L)), "seq": jnp.broadcast_to(jnp.arange(B)[:, None], (B, L)),
          "gen_mask": jnp.broadcast_to(gen, (B, L)), "inf_logprobs": jnp.full((B, L), -4.0),
          "routing": jnp.full((CFG.num_hidden_layers, B, L, CFG.num_experts_per_tok), -1, jnp.int32),
          "reward": jnp.asarray([1.0, 0.0, 0.5, 0.0]), "passed": jnp.asarray([1.0, 0, 0, 0]),
          "group": jnp.asarray([0, 0, 1, 1], jnp.int32), "first": jnp.ones(B), "valid": jnp.ones(B),
          "is_cap": jnp.full(B, 2.0), "staleness": jnp.zeros(B, jnp.int32), "traj_gen_tokens": jnp.full(B, 7.0)}


@pytest.fixture(scope="module")
def grads():
  """Gradients and metrics of the RL loss with the MTP term off, on with the trunk stopped, and on through it."""
  params, ref = model.init(jax.random.key(0), CFG), model.init(jax.random.key(7), CFG)
  batch = _batch()
  out = {}
  for name, rl_cfg in {"off": rl_step_lib.RLConfig(),
                       "stopped": rl_step_lib.RLConfig(mtp_weight=1.0),
                       "through": rl_step_lib.RLConfig(mtp_weight=1.0, mtp_trunk_grad=True)}.items():
    fn = lambda p, c=rl_cfg: rl_step_lib.rl_loss_fn(p, batch, ref, model_cfg=CFG, rl_cfg=c)
    (_, (metrics, _)), g = jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
    out[name] = g, metrics
  return out


def _max_abs(tree):
  return max(float(jnp.abs(x).max()) for x in jax.tree.leaves(tree))


def _trunk(g):
  return {k: v for k, v in g.items() if k != "mtp"}


def test_stopped_mtp_term_leaves_the_trunk_gradient_unchanged(grads):
  off, stopped = grads["off"][0], grads["stopped"][0]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), _trunk(off), _trunk(stopped))
  assert _max_abs(off["mtp"]) == 0.0            # weight 0: the metric's MTP forward is not differentiated
  assert _max_abs(stopped["mtp"]) > 1e-4        # weight > 0: the MTP modules learn


def test_mtp_term_through_the_trunk_changes_its_gradient(grads):
  off, through = _trunk(grads["off"][0]), _trunk(grads["through"][0])
  diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), off, through)
  assert max(jax.tree.leaves(diff)) > 1e-4
  assert float(jnp.abs(off["embed"] - through["embed"]).max()) > 1e-5   # the MTP module reads the embedding


def test_mtp_metrics_are_reported_with_and_without_training(grads):
  for name in ("off", "stopped", "through"):
    m = grads[name][1]
    assert 0.0 <= float(m["mtp_agreement"]) <= 1.0 and 0.0 < float(m["mtp_acceptance"]) <= 1.0
    assert float(m["mtp_loss"]) > 0.0
  # The MTP term is added to the policy loss only when trained.
  np.testing.assert_allclose(grads["off"][1]["loss"], grads["off"][1]["pg_loss"])
  m = grads["stopped"][1]
  np.testing.assert_allclose(m["loss"], m["pg_loss"] + m["mtp_loss"], rtol=1e-6)


def test_start_drafter_metrics_equal_the_drafters_own_when_nothing_has_moved():
  params = model.init(jax.random.key(0), CFG)
  rl_cfg = rl_step_lib.RLConfig(mtp_start_metrics=True)
  _, (m, _) = jax.jit(lambda p: rl_step_lib.rl_loss_fn(p, _batch(), p, model_cfg=CFG, rl_cfg=rl_cfg))(params)
  np.testing.assert_allclose(m["mtp_start_acceptance"], m["mtp_acceptance"], rtol=1e-5)
  np.testing.assert_allclose(m["mtp_start_agreement"], m["mtp_agreement"])
  moved = {**params, "mtp": jax.tree.map(lambda x: x + 0.05, params["mtp"])}   # the drafter trained on
  _, (m, _) = jax.jit(lambda p: rl_step_lib.rl_loss_fn(p, _batch(), params, model_cfg=CFG, rl_cfg=rl_cfg))(moved)
  assert abs(float(m["mtp_start_acceptance"]) - float(m["mtp_acceptance"])) > 1e-4


def test_rl_optimizer_freezes_mtp_only_when_it_is_not_trained():
  params = {"mtp": {"w": jnp.ones((2, 2))}, "embed": jnp.ones((2, 2))}
  g = jax.tree.map(jnp.ones_like, params)
  for weight, moves in ((0.0, False), (0.5, True)):
    opt = optim.make_optimizer(OptimConfig(warmup_steps=0), params,
                               frozen=rl_step_lib.RLConfig(mtp_weight=weight).frozen_subtrees)
    updates, _ = opt.update(g, opt.init(params), params)
    assert (float(jnp.abs(updates["mtp"]["w"]).max()) > 0) == moves
    assert float(jnp.abs(updates["embed"]).max()) > 0


def test_mtp_config_on_a_model_without_mtp_modules_is_a_no_op():
  cfg = dataclasses.replace(CFG, num_nextn_predict_layers=0)
  params = model.init(jax.random.key(0), cfg)
  _, (m, _) = rl_step_lib.rl_loss_fn(params, _batch(), params, model_cfg=cfg,
                                     rl_cfg=rl_step_lib.RLConfig(mtp_weight=1.0, mtp_trunk_grad=True))
  assert "mtp_loss" not in m
  np.testing.assert_allclose(m["loss"], m["pg_loss"])
