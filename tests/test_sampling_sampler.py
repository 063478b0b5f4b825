"""Sampling distributions against a NumPy reference, and the rejection step's output distribution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.sampling import sampler
from composer_jax.sampling.speculative import accept_or_resample

ROWS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (1.3, 5, 0.8), (0.0, 0, 1.0), (0.5, 1, 0.3),
        (2.0, 100, 0.95)]  # (temperature, top_k, top_p)


def _logits(n_rows, V=12, seed=0):
  # Distinct, well-separated logits so top-p cuts are far from float32 rounding at the boundaries.
  rng = np.random.default_rng(seed)
  return np.stack([rng.permutation(np.linspace(-3.0, 3.0, V)) for _ in range(n_rows)]).astype(np.float32)


def test_sampling_logprobs_match_reference():
  logits = _logits(len(ROWS))
  t, k, p = (jnp.asarray(c) for c in zip(*ROWS))
  got = np.exp(np.asarray(sampler.sampling_logprobs(jnp.asarray(logits), t.astype(jnp.float32), k.astype(jnp.int32),
                                                    p.astype(jnp.float32))))
  for row, (temp, top_k, top_p) in enumerate(ROWS):
    np.testing.assert_allclose(got[row], sampler.sampling_probs_reference(logits[row], temp, top_k, top_p),
                               atol=1e-6, err_msg=f"row {row}: {temp=} {top_k=} {top_p=}")


def test_policy_logprobs_are_tempered_full_softmax():
  logits = _logits(2)
  got = sampler.policy_logprobs(jnp.asarray(logits), jnp.array([0.5, 0.0]))
  np.testing.assert_allclose(got[0], jax.nn.log_softmax(logits[0] / 0.5), atol=1e-6)
  np.testing.assert_allclose(got[1], jax.nn.log_softmax(logits[1]), atol=1e-6)  # greedy rows score at T=1


def test_policy_entropy_hand_computed():
  """p = (1/4, 3/4) at T = 1: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623; the same logits doubled at T = 2 are the same
  distribution; a uniform row over 4 tokens is ln 4; a greedy row (T = 0) is scored at T = 1."""
  logits = jnp.asarray([[0.0, np.log(3.0), -np.inf, -np.inf], [0.0, 2 * np.log(3.0), -np.inf, -np.inf],
                        [1.0, 1.0, 1.0, 1.0], [0.0, np.log(3.0), -np.inf, -np.inf]])
  got = sampler.policy_entropy(logits, jnp.asarray([1.0, 2.0, 0.5, 0.0]))
  np.testing.assert_allclose(got, [0.562335, 0.562335, np.log(4.0), 0.562335], rtol=1e-5)


def test_draw_frequencies_match_distribution():
  probs = np.array([0.5, 0.25, 0.15, 0.1, 0.0])
  n = 20000
  keys = jax.random.split(jax.random.key(0), n)
  toks = np.asarray(sampler.draw(keys, jnp.log(jnp.tile(jnp.asarray(probs, jnp.float32), (n, 1)))))
  freq = np.bincount(toks, minlength=5) / n
  # 4.5 binomial standard deviations: fails by chance with probability < 1e-4 per entry.
  np.testing.assert_array_less(np.abs(freq - probs), 4.5 * np.sqrt(probs * (1 - probs) / n) + 1e-9)


def test_step_keys_depend_on_row_seed_index_and_stream():
  base = jax.vmap(jax.random.key)(jnp.array([1, 1, 2], jnp.uint32))
  k = jax.random.key_data(sampler.step_keys(base, jnp.array([0, 0, 0])))
  assert (k[0] == k[1]).all() and not (k[0] == k[2]).all()
  assert not (jax.random.key_data(sampler.step_keys(base, jnp.array([1, 1, 1])))[0] == k[0]).all()
  assert not (jax.random.key_data(sampler.step_keys(base, jnp.array([0, 0, 0]), stream=1))[0] == k[0]).all()


@pytest.mark.parametrize("case", ["random", "disjoint", "greedy"])
def test_rejection_step_outputs_target_distribution(case):
  """Draft d ~ q, accept with min(1, p/q), else resample from (p - q)+: the token is distributed as p."""
  V, n = 6, 40000
  rng = np.random.default_rng(3)
  p = rng.dirichlet(np.ones(V))
  q = rng.dirichlet(np.ones(V))
  if case == "disjoint":  # the draft never proposes a token p likes: every draft is rejected
    p, q = np.array([0.6, 0.4, 0, 0, 0, 0]), np.array([0, 0, 0.3, 0.3, 0.2, 0.2])
  if case == "greedy":
    p, q = np.eye(V)[2], np.eye(V)[4]
  p_lp = jnp.log(jnp.tile(jnp.asarray(p, jnp.float32), (n, 1)))
  q_lp = jnp.log(jnp.tile(jnp.asarray(q, jnp.float32), (n, 1)))
  k_d, k_a, k_r = (jax.random.split(k, n) for k in jax.random.split(jax.random.key(7), 3))
  d = sampler.draw(k_d, q_lp)
  accepted, tok = jax.jit(accept_or_resample)(k_a, k_r, p_lp, q_lp, d)
  freq = np.bincount(np.asarray(tok), minlength=V) / n
  np.testing.assert_array_less(np.abs(freq - p), 4.5 * np.sqrt(p * (1 - p) / n) + 1e-9)
  # Acceptance rate is sum_x min(p, q) (the overlap of the two distributions).
  overlap = np.minimum(p, q).sum()
  assert abs(np.asarray(accepted).mean() - overlap) < 4.5 * np.sqrt(overlap * (1 - overlap) / n) + 1e-9
