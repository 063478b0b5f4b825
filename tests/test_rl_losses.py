"""RL losses against hand-computed values: advantages, truncated importance weights, k1 KL, masks, normalisations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.rl import losses
from composer_jax.rl.batch import BatchConfig, make_batch

LN = np.log


def test_group_advantages_count_each_trajectory_once():
  # rows: traj a (group 0), traj b as two segments (group 0), traj c alone (group 1), one padding row.
  reward = jnp.array([1.0, 0.0, 0.0, 0.5, 7.0])
  group = jnp.array([0, 0, 0, 1, 0])
  first = jnp.array([1.0, 1.0, 0.0, 1.0, 1.0])
  valid = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0])
  adv = losses.group_advantages(reward, group, first, valid)
  # group 0 mean over trajectories = (1 + 0) / 2 (not over rows, and the padding row's 7 is ignored)
  np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.0, 0.0])
  adv_std = losses.group_advantages(reward, group, first, valid, scale_by_std=True, eps=1e-6)
  # group 0 std (ddof 0) = 0.5; group 1 has one member: 0 / eps stays 0.
  np.testing.assert_allclose(adv_std, [0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.0, 0.0], rtol=1e-6)


def test_token_logprobs_and_entropy_alignment():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 4, 5)).astype(np.float32)
  tokens = rng.integers(0, 5, (2, 4))
  # The identity as the head (D = V): the hidden states are the logits.
  lp, ent = map(np.asarray, losses.token_logprobs(jnp.asarray(logits), jnp.eye(5), jnp.asarray(tokens),
                                                  with_entropy=True))
  np.testing.assert_array_equal(losses.token_logprobs(jnp.asarray(logits), jnp.eye(5), jnp.asarray(tokens)), lp)
  for b in range(2):
    assert lp[b, 0] == 0 and ent[b, 0] == 0
    for t in range(1, 4):
      p = np.exp(logits[b, t - 1]) / np.exp(logits[b, t - 1]).sum()
      np.testing.assert_allclose(lp[b, t], np.log(p[tokens[b, t]]), rtol=1e-5)
      np.testing.assert_allclose(ent[b, t], -(p * np.log(p)).sum(), rtol=1e-5)


# The hand-computed example (B = 2 rows, L = 3; generated tokens: row 0 at t = 1, 2; row 1 at t = 2):
#   ρ   = π_θ/μ : row 0 → 0.5/0.25 = 2 and 0.25/0.25 = 1; row 1 → 0.5/0.5 = 1. Cap c = 1.5 → w = 1.5, 1, 1.
#   k1  = log π_θ − log π_ref = 0.2, −0.1 (row 0); 0.3 (row 1). β = 0.5.
#   A   = 1 (row 0), −2 (row 1) → A_t = 1 − 0.1 = 0.9, 1 + 0.05 = 1.05; −2 − 0.15 = −2.15.
#   ℓ_t = −w·A_t = −1.35, −1.05, +2.15.
LOGP = np.array([[0.0, LN(0.5), LN(0.25)], [0.0, 0.0, LN(0.5)]], np.float32)
INF = np.array([[0.0, LN(0.25), LN(0.25)], [0.0, 0.0, LN(0.5)]], np.float32)
REF = LOGP - np.array([[0.0, 0.2, -0.1], [0.0, 0.0, 0.3]], np.float32)
ADV = np.array([1.0, -2.0], np.float32)
MASK = np.array([[0, 1, 1], [0, 0, 1]], np.float32)
CAP = np.array([1.5, 1.5], np.float32)


@pytest.mark.parametrize("normalize, importance, expected", [
    ("tokens", "truncate", (-1.35 - 1.05 + 2.15) / 3),
    ("sequence", "truncate", ((-1.35 - 1.05) / 2 + 2.15) / 2),
    ("constant", "truncate", (-1.35 - 1.05 + 2.15) / 6),            # B·L = 6
    ("tokens", "none", (-0.9 - 1.05 + 2.15) / 3),                   # w = 1
])
def test_policy_loss_hand_computed(normalize, importance, expected):
  cfg = losses.LossConfig(kl_coef=0.5, normalize=normalize, importance=importance)
  loss, m = losses.policy_loss(jnp.asarray(LOGP), jnp.asarray(INF), jnp.asarray(REF), jnp.asarray(ADV),
                               jnp.asarray(MASK), jnp.asarray(CAP), cfg)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_allclose(m["kl"], (0.2 - 0.1 + 0.3) / 3, rtol=1e-5)
  np.testing.assert_allclose(m["importance_ratio_mean"], 4 / 3, rtol=1e-5)
  np.testing.assert_allclose([m["importance_ratio_min"], m["importance_ratio_max"]], [1.0, 2.0], rtol=1e-5)
  np.testing.assert_allclose(m["clip_fraction"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["logprob_gap"], np.log(2) / 3, rtol=1e-5)
  assert float(m["generated_tokens"]) == 3


def test_policy_loss_gradient_is_truncated_weighted_advantage_with_k1_penalty():
  cfg = losses.LossConfig(kl_coef=0.5)
  grad = jax.grad(lambda lp: losses.policy_loss(lp, jnp.asarray(INF), jnp.asarray(REF), jnp.asarray(ADV),
                                                jnp.asarray(MASK), jnp.asarray(CAP), cfg)[0])(jnp.asarray(LOGP))
  # d loss / d log π_θ(y_t) = −w_t·A_t / N on generated tokens, 0 elsewhere (masks, and μ, π_ref, A are constants).
  expected = np.array([[0.0, -1.35, -1.05], [0.0, 0.0, 2.15]]) / 3
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_k1_penalty_gradient_is_the_kl_gradient():
  """With A = 0 and on-policy tokens, E[gradient] over tokens equals ∇ KL(π_θ ‖ π_ref) for a softmax policy."""
  rng = np.random.default_rng(1)
  V = 4
  theta = jnp.asarray(rng.normal(size=V), jnp.float32)
  ref = jax.nn.log_softmax(jnp.asarray(rng.normal(size=V), jnp.float32))
  cfg = losses.LossConfig(kl_coef=1.0, normalize="constant", norm_constant=1.0)

  def loss_for_token(th, y):                         # one generated token y with μ = π_θ (ρ = 1)
    lp = jax.nn.log_softmax(th)[y]
    row = lambda x: jnp.stack([0.0, x])[None]        # position 0 carries no loss
    return losses.policy_loss(row(lp), row(jax.lax.stop_gradient(lp)), row(ref[y]), jnp.zeros(1),
                              jnp.array([[0.0, 1.0]]), jnp.array([2.0]), cfg)[0]

  p = jax.nn.softmax(theta)
  grads_VxV = jax.jit(jax.vmap(jax.grad(loss_for_token), in_axes=(None, 0)))(theta, jnp.arange(V))
  expected_grad = p @ grads_VxV                      # exact expectation over the sampled token
  kl = lambda th: jnp.sum(jax.nn.softmax(th) * (jax.nn.log_softmax(th) - ref))
  np.testing.assert_allclose(expected_grad, jax.grad(kl)(theta), rtol=1e-5, atol=1e-6)


def test_loss_config_validation():
  with pytest.raises(ValueError, match="normalize"):
    losses.LossConfig(normalize="mean")
  with pytest.raises(ValueError, match="importance"):
    losses.LossConfig(importance="clip")


def _traj(tokens, gen, logprobs, reward, routed=None, solved=None):
  seg = {"tokens_T": np.asarray(tokens, np.int32), "gen_mask_T": np.asarray(gen, np.int8),
         "logprobs_T": np.asarray(logprobs, np.float32), "routed_TxNxK": routed}
  t = {"task_id": "t", "segments": [seg], "reward": reward}
  if solved is not None:
    t["metrics"] = {"solved": solved}
  return t


def test_make_batch_layout():
  routed = np.full((4, 1, 2), -1, np.int32)
  routed[2:] = [[[3, 1]], [[0, 7]]]
  a = _traj([5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -0.5, -0.25], 1.0, routed, solved=1.0)
  b = _traj([5, 9, 9], [1, 1, 0], [-1, -2, 0], 0.0)                 # dense engine (no routing); first token masked
  b2 = {**b, "segments": [b["segments"][0], a["segments"][0]]}      # a two-segment trajectory
  cfg = BatchConfig(rows=5, length=6, n_moe_layers=1, top_k=2, is_cap=2.0, stale_is_cap=1.2)
  out = make_batch([[a, b2], [b]], cfg, staleness=[1, 4], over_stale=[False, True])
  np.testing.assert_array_equal(out["tokens"][0], [5, 6, 7, 8, 0, 0])
  np.testing.assert_array_equal(out["segment_ids"][1], [1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(out["gen_mask"][1], [0, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(out["routing"][0, 0, :, 0], [-1, -1, 3, 0, -1, -1])
  np.testing.assert_array_equal(out["routing"][0, 1], -1)
  np.testing.assert_array_equal(out["group"], [0, 0, 0, 1, 0])
  np.testing.assert_array_equal(out["first"], [1, 1, 0, 1, 0])
  np.testing.assert_array_equal(out["valid"], [1, 1, 1, 1, 0])
  np.testing.assert_array_equal(out["passed"], [1, 0, 0, 0, 0])
  np.testing.assert_array_equal(out["traj_gen_tokens"], [2, 4, 4, 2, 0])
  np.testing.assert_allclose(out["is_cap"], [2.0, 2.0, 2.0, 1.2, 2.0])
  np.testing.assert_array_equal(out["staleness"], [1, 1, 1, 4, 0])
  with pytest.raises(ValueError, match="more than the batch length"):
    make_batch([[a]], BatchConfig(rows=2, length=3, n_moe_layers=1, top_k=2))
  with pytest.raises(ValueError, match="need 3 rows"):
    make_batch([[a, b2]], BatchConfig(rows=2, length=6, n_moe_layers=1, top_k=2))
  with pytest.raises(ValueError, match="layers, top_k"):
    make_batch([[a]], BatchConfig(rows=2, length=6, n_moe_layers=2, top_k=2))
