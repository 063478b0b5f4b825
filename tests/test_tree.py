"""rollout/tree.py: node credit against hand-computed values, the flat case, the estimator's expectation, bad trees."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.rl import losses
from rollout import tree as tree_lib
from tests import tree_testlib as tl

# root ─ A (tokens 1 2) ─ leaf A0 (3, env 60, 4) r=1 ; leaf A1 (5) r=0
#      └ B (tokens 6)   ─ leaf B0 (7) r=1            ; leaf B1 (8 9) r=1
NODES = {(0,): [1, 2], (0, 0): [3, 60, 4], (0, 1): [5], (1,): [6], (1, 0): [7], (1, 1): [8, 9]}
REWARDS = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 1.0, (1, 1): 1.0}


def test_node_credit_hand_computed():
  t = tree_lib.build(tl.tree_group(NODES, REWARDS))
  n = t.nodes
  # V(A) = 0.5, V(B) = 1, their mean 0.75; leaves against their sibling's mean.
  assert (n[()].value, n[()].count, t.size) == (0.75, 4, 4)
  assert (n[(0,)].value, n[(0,)].advantage, n[(0,)].count) == (0.5, -0.25, 2)
  assert (n[(1,)].value, n[(1,)].advantage, n[(1,)].count) == (1.0, 0.25, 2)
  assert [n[p].advantage for p in REWARDS] == [0.5, -0.5, 0.0, 0.0]
  assert [n[p].owner for p in [(0,), (1,)] + list(REWARDS)] == [0, 2, 0, 1, 2, 3]


def test_token_credit_trains_each_shared_token_once_with_its_leaf_count():
  credit = tree_lib.token_credit(tl.tree_group(NODES, REWARDS))
  (a0,), (a1,), (b0,), (b1,) = credit
  # Leaf A0 = prompt(3) | A: 1 2 | A0: 3 env 4 — owns A, so A's tokens are trained here with weight 2.
  np.testing.assert_array_equal(a0["train_T"], [0, 0, 0, 1, 1, 1, 0, 1])
  np.testing.assert_array_equal(a0["advantage_T"][3:], [-0.25, -0.25, 0.5, 0.5, 0.5])
  np.testing.assert_array_equal(a0["weight_T"][3:], [2, 2, 1, 1, 1])
  # Leaf A1 = prompt | A: 1 2 | A1: 5 — A's tokens are context here (trained on A0's row).
  np.testing.assert_array_equal(a1["train_T"], [0, 0, 0, 0, 0, 1])
  np.testing.assert_array_equal(a1["advantage_T"][5:], [-0.5])
  np.testing.assert_array_equal(b0["train_T"], [0, 0, 0, 1, 1])
  np.testing.assert_array_equal(b0["advantage_T"][3:], [0.25, 0.0])
  np.testing.assert_array_equal(b1["train_T"], [0, 0, 0, 0, 1, 1])
  # Every generated token of the unrolled leaves is accounted for exactly once with its multiplicity:
  unrolled = sum(int(np.sum(s["gen_mask_T"])) for g in [tl.tree_group(NODES, REWARDS)] for t in g
                 for s in t["segments"])
  assert sum(float(np.sum(r["train_T"] * r["weight_T"])) for leaf in credit for r in leaf) == unrolled


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 1.0, 1.0], [0.5, -0.25, 1.0, 0.0, 2.0, 0.75, 1.0, 1.0],
                                     [0.3, -1.7, 2.2, 0.9, 0.11, 5.0]])
def test_flat_group_is_todays_group_advantages(rewards):
  """A group without tree specs is the tree that branches once at the prompt: reward − group mean."""
  group = tl.flat_group([[i + 1, i + 2] for i in range(len(rewards))], rewards)
  credit = tree_lib.token_credit(group)
  got = np.asarray([c[0]["advantage_T"][-1] for c in credit])
  G = len(rewards)
  want = np.asarray(losses.group_advantages(jnp.asarray(rewards), jnp.zeros(G, jnp.int32), jnp.ones(G),
                                            jnp.ones(G)))
  if len(rewards) in (4, 8) and all(float(r * 4).is_integer() for r in rewards):   # every sum and mean exact
    np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # float32 rounding of the mean (f64 here)
  assert all((c[0]["weight_T"] == 1).all() for c in credit)
  np.testing.assert_array_equal(credit[0][0]["train_T"], group[0]["segments"][0]["gen_mask_T"])


def test_sibling_mean_is_leave_one_out_times_b_minus_one_over_b():
  rng = np.random.default_rng(0)
  fan = (3, 2)
  leaves = list(itertools.product(range(fan[0]), range(fan[1])))
  nodes = {p: [int(rng.integers(1, 50))] for p in [(i,) for i in range(fan[0])] + leaves}
  t = tree_lib.build(tl.tree_group(nodes, {p: float(rng.normal()) for p in leaves}))
  for path, node in t.nodes.items():
    if not node.children:
      continue
    b, vals = len(node.children), [t.nodes[c].value for c in node.children]
    for c, v in zip(node.children, vals, strict=True):
      loo = v - (sum(vals) - v) / (b - 1)
      assert t.nodes[c].advantage == pytest.approx((b - 1) / b * loo, abs=1e-12), path


def test_multiplicity_is_identical_leaves():
  """An episode that ended before the next branch point (multiplicity 2) = two leaves with empty last nodes."""
  nodes = {(0,): [1, 2], (1,): [3], (1, 0): [4], (1, 1): [5], (0, 0): [], (0, 1): []}
  short = tree_lib.build(tl.tree_group(nodes, {(0,): 0.25, (1, 0): 1.0, (1, 1): 0.0}, multiplicity={(0,): 2}))
  full = tree_lib.build(tl.tree_group(nodes, {(0, 0): 0.25, (0, 1): 0.25, (1, 0): 1.0, (1, 1): 0.0}))
  for p in [(), (0,), (1,), (1, 0), (1, 1)]:
    assert (short.nodes[p].count, short.nodes[p].value, short.nodes[p].advantage) == \
      (full.nodes[p].count, full.nodes[p].value, full.nodes[p].advantage), p
  assert short.size == 4


def test_branch_across_a_summary_boundary():
  """Leaves share all of segment 0 (ending in a generated summary) and segment 1 up to the branch point."""
  seg0 = list(tl.PROMPT) + [1, 2, 60, 3, 4]                  # turn, tool output, summary tokens 3 4
  seg1_head = list(tl.PROMPT) + [55, 56]                      # the next segment's prompt holds the summary
  leaves = []
  for j, (tail, r) in enumerate([([5, 6], 1.0), ([7], 0.0), ([8], 0.0)]):
    segs = [tl.segment(seg0), tl.segment(seg1_head + [9] + tail)]
    leaves.append({"task_id": "t", "segments": segs, "reward": r, "metrics": {},
                   "tree": {"path": [0, j], "starts": [[0, 3], [1, 6]], "multiplicity": 1}})
  credit = tree_lib.token_credit(leaves)
  # node 0 (value 1/3, the root's only child: advantage 0) owns segment 0's generated tokens and token 9.
  assert tree_lib.build(leaves).nodes[(0,)].advantage == 0.0
  np.testing.assert_array_equal(credit[0][0]["train_T"], [0, 0, 0, 1, 1, 0, 1, 1])
  np.testing.assert_array_equal(credit[0][0]["weight_T"][3:], [3] * 5)
  np.testing.assert_array_equal(credit[0][1]["train_T"], [0] * 5 + [1, 1, 1])
  np.testing.assert_array_equal(credit[0][1]["weight_T"][5:], [3, 1, 1])
  np.testing.assert_allclose(credit[0][1]["advantage_T"][5:], [0, 2 / 3, 2 / 3])
  assert not credit[1][0]["train_T"].any() and not credit[2][0]["train_T"].any()
  np.testing.assert_array_equal(credit[1][1]["train_T"], [0] * 6 + [1])
  np.testing.assert_allclose(credit[1][1]["advantage_T"][6:], [-1 / 3])


def _bad(mutate, match):
  group = tl.tree_group(NODES, REWARDS)
  mutate(group)
  with pytest.raises(ValueError, match=match):
    tree_lib.token_credit(group)


def test_malformed_trees_name_the_node():
  def dup(g):
    g[1]["tree"]["path"] = [0, 0]
  _bad(dup, r"node 0/0: trajectory 0 ends there but other trajectories \[1\]")

  def ancestor(g):
    g[1]["tree"].update(path=[0], starts=[[0, 3]])
  _bad(ancestor, r"node 0: trajectory 1 ends there")

  def shared_token(g):
    g[1]["segments"][0]["tokens_T"][4] = 42
  _bad(shared_token, r"node 0: trajectory 1 differs from trajectory 0 on the tokens they share")

  def moved(g):
    g[1]["tree"]["starts"][0] = [0, 2]
  _bad(moved, r"node 0: trajectories 0 and 1 disagree on where it starts")

  def children_apart(g):
    g[1]["tree"]["starts"][1] = [0, 4]
  _bad(children_apart, r"node 0: its children start at different points")

  def mixed(g):
    g[2]["tree"] = None
  _bad(mixed, r"trajectories 2 and 0 disagree on whether the group is a tree")

  def early(g):
    for leaf in g:
      leaf["segments"][0]["gen_mask_T"][0] = 1
  _bad(early, r"trajectory 0 .* segment 0: generated tokens before its first node")

  def outside(g):
    g[3]["tree"]["starts"][1] = [2, 0]
  _bad(outside, r"trajectory 3 .* node 1/1 starts at \(2, 0\), outside its token stream")

  def malformed(g):
    del g[0]["tree"]["starts"]
  _bad(malformed, r"trajectory 0 .* malformed tree spec")


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_monte_carlo_bandit_matches_exact_gradient():
  """A two-step bandit (a1 ~ π1, then a2 ~ π2(·|a1), reward R(a1, a2)) sampled as a tree with fan-out b at both
  steps: the tree estimator's mean gradient is (b − 1)/b times the exact policy gradient (module docstring)."""
  th1, th2 = np.array([0.2, -0.3]), np.array([[0.5, -0.5], [-0.2, 0.4]])
  R = np.array([[1.0, 0.0], [0.2, 0.9]])
  p1, p2 = _softmax(th1), _softmax(th2)
  q1 = (p2 * R).sum(1)
  exact = np.concatenate([p1 * (q1 - p1 @ q1), (p1[:, None] * p2 * (R - (p2 * R).sum(1, keepdims=True))).ravel()])
  b, M = 2, 3000
  rng = np.random.default_rng(1)
  samples = []
  for _ in range(M):
    a1 = rng.choice(2, size=b, p=p1)
    nodes, rewards = {}, {}
    for i in range(b):
      nodes[(i,)] = [int(a1[i])]
      for j in range(b):
        a2 = int(rng.choice(2, p=p2[a1[i]]))
        nodes[(i, j)], rewards[(i, j)] = [2 + a2], R[a1[i], a2]
    credit = tree_lib.token_credit(tl.tree_group(nodes, rewards))
    g1, g2 = np.zeros(2), np.zeros((2, 2))
    for (i, j), (row,) in zip(rewards, credit, strict=True):
      wa = row["train_T"] * row["weight_T"] * row["advantage_T"]    # the loss weight of each token
      g1 += wa[3] * (np.eye(2)[a1[i]] - p1)                           # position 3: a1 (trained on its owner)
      a2 = nodes[(i, j)][0] - 2
      g2[a1[i]] += wa[4] * (np.eye(2)[a2] - p2[a1[i]])
    samples.append(np.concatenate([g1, g2.ravel()]) / b**2)
  samples = np.asarray(samples)
  mean, se = samples.mean(0), samples.std(0) / np.sqrt(M)
  np.testing.assert_array_less(np.abs(mean - (b - 1) / b * exact), 4 * se + 1e-9)
  assert np.any(np.abs(mean - exact) > 6 * se)    # the constant matters: the plain exact gradient is rejected
