"""Loss pieces of the LM trainer against hand-computed values."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composer_jax.model import head
from composer_jax.train import losses, optim, step
from composer_jax.train.config import OptimConfig


def test_shifted_targets_respect_segments_padding_and_mask():
  tokens = jnp.array([[5, 6, 7, 8, 9, 0]])
  seg = jnp.array([[1, 1, 1, 2, 2, 0]])        # two packed documents, then padding
  mask = jnp.array([[1, 1, 0, 1, 1, 0]])       # token 7 is not a target (e.g. a prompt token in SFT)
  targets, tmask = losses.shifted_targets(tokens, seg, mask, 1)
  np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 0, 0]])
  # t=0 → 6 ok; t=1 → 7 masked; t=2 → 8 crosses documents; t=3 → 9 ok; t=4 → padding; t=5 padding.
  np.testing.assert_array_equal(tmask, [[1, 0, 0, 1, 0, 0]])
  _, tmask2 = losses.shifted_targets(tokens, seg, mask, 2)
  np.testing.assert_array_equal(tmask2, [[0, 0, 0, 0, 0, 0]])   # t=0 → 7 masked, t=1 → 8 other doc, ...


def test_masked_mean_hand_computed():
  """The one masked mean of the LM and RL losses: over the masked-in positions only, 0 when there are none."""
  x = jnp.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
  assert float(losses.masked_mean(x, jnp.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))) == pytest.approx(21.0 / 3)
  assert float(losses.masked_mean(x, jnp.zeros((2, 3)))) == 0.0


def test_cross_entropy_hand_computed():
  # With the identity as the head (D = V), the hidden states are the logits.
  h = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))
  targets = jnp.array([[0, 2]])
  ce, n = head.cross_entropy(h, jnp.eye(3), targets, jnp.array([[1.0, 1.0]]))
  np.testing.assert_allclose(ce, (np.log(2) + np.log(10)) / 2, rtol=1e-6)
  assert float(n) == 2
  ce, n = head.cross_entropy(h, jnp.eye(3), targets, jnp.array([[0.0, 1.0]]))
  np.testing.assert_allclose(ce, np.log(10), rtol=1e-6)


def test_mtp_self_distillation_targets_main_head_at_next_position():
  rng = np.random.default_rng(0)
  B, L, V = 1, 5, 4
  main = jnp.asarray(rng.normal(size=(B, L, V)), jnp.float32)    # identity head: hiddens are the logits
  mtp = jnp.asarray(rng.normal(size=(1, B, L, V)), jnp.float32)
  w = jnp.eye(V)
  tokens = jnp.array([[1, 2, 3, 0, 1]])
  seg = jnp.ones((B, L), jnp.int32)
  mask = jnp.ones((B, L), jnp.int32)
  loss, agree = losses.mtp_losses(main, mtp, w, w, tokens, seg, mask, "self_distill")
  # MTP module 1 at t predicts token t+2, which the main head predicts at t+1; valid t = 0, 1, 2.
  p = jax.nn.softmax(main[0, 1:4], -1)
  logq = jax.nn.log_softmax(mtp[0, 0, 0:3], -1)
  expected = float(jnp.mean(-jnp.sum(p * logq, -1)))
  np.testing.assert_allclose(loss[0], expected, rtol=1e-6)
  expected_agree = np.mean(np.argmax(mtp[0, 0, 0:3], -1) == np.argmax(main[0, 1:4], -1))
  np.testing.assert_allclose(agree[0], expected_agree)
  ce_loss, ce_agree = losses.mtp_losses(main, mtp, w, w, tokens, seg, mask, "cross_entropy")
  logq_t = jax.nn.log_softmax(mtp[0, 0], -1)
  np.testing.assert_allclose(ce_loss[0], -np.mean([logq_t[0, 3], logq_t[1, 0], logq_t[2, 1]]), rtol=1e-6)
  np.testing.assert_allclose(ce_agree[0], expected_agree)
  with pytest.raises(ValueError, match="Unknown MTP loss mode 'kl'"):
    losses.mtp_losses(main, mtp, w, w, tokens, seg, mask, "kl")


def test_mtp_self_distillation_gradient_reaches_only_the_student():
  rng = np.random.default_rng(1)
  B, L, V = 1, 6, 5
  main = jnp.asarray(rng.normal(size=(B, L, V)), jnp.float32)
  mtp = jnp.asarray(rng.normal(size=(2, B, L, V)), jnp.float32)
  tokens, seg, mask = jnp.zeros((B, L), jnp.int32), jnp.ones((B, L), jnp.int32), jnp.ones((B, L), jnp.int32)
  g_main, g_mtp, g_w = jax.grad(lambda h, m, w: jnp.sum(losses.mtp_losses(h, m, w, w, tokens, seg, mask,
                                                                          "self_distill")[0]), (0, 1, 2))(
      main, mtp, jnp.eye(V))

  def plain(m):   # the same loss on full logits: −Σ softmax(teacher) · log_softmax(student), masked mean
    out = []
    for k in range(2):
      t = jax.nn.softmax(jnp.roll(main, -(k + 1), axis=1), -1)
      ce = -jnp.sum(t * jax.nn.log_softmax(m[k], -1), -1)
      out.append(jnp.sum(ce[:, :L - k - 2]) / (L - k - 2))
    return sum(out)
  assert float(jnp.abs(g_main).max()) == 0.0                       # the teacher is held fixed
  np.testing.assert_allclose(g_mtp, jax.grad(plain)(mtp), atol=1e-6)
  assert float(jnp.abs(g_w).max()) > 0                              # through the student's head only


def test_router_bias_update_rule():
  params = {"moe_layers": {"moe": {"bias": jnp.zeros((1, 4)), "router": jnp.ones((1, 4))}},
            "mtp": {"block": {"moe": {"bias": jnp.zeros((1, 4))}}}}
  load = jnp.array([[3.0, 1.0, 0.0, 4.0]])                    # mean 2: experts 0 and 3 overloaded
  mtp_load = jnp.array([[0.0, 2.0, 2.0, 0.0]])                 # mean 1
  new = step.update_router_bias(params, {"moe_layers": load, "mtp": mtp_load}, rate=0.01)
  np.testing.assert_allclose(new["moe_layers"]["moe"]["bias"], [[-0.01, 0.01, 0.01, -0.01]])
  np.testing.assert_allclose(new["mtp"]["block"]["moe"]["bias"], [[0.01, -0.01, -0.01, 0.01]])
  np.testing.assert_array_equal(new["moe_layers"]["moe"]["router"], params["moe_layers"]["moe"]["router"])
  with pytest.raises(ValueError, match="does not match router bias"):
    step.update_router_bias(params, {"moe_layers": load[:, :3]}, rate=0.01)


def test_optimizer_never_moves_router_bias_and_decays_only_matrices():
  params = {"w": jnp.ones((2, 3)), "norm": {"scale": jnp.ones((2, 3))},
            "moe": {"bias": jnp.ones((2, 3))}}
  grads = jax.tree.map(jnp.ones_like, params)
  opt = optim.make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5), params)
  state = opt.init(params)
  for _ in range(3):
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["moe"]["bias"], 1.0)
  assert float(params["w"][0, 0]) < float(params["norm"]["scale"][0, 0]) < 1.0   # decay pulls w further
