"""Credit in a tree of rollouts: each branch scored against its siblings, each shared token trained once.

A group may be sampled as a tree instead of G independent trajectories (`rollout.tree_harness`): the root is the
prompt, each node a run of tokens, each internal node's children b continuations sampled from the same state
(the sandbox forked, the context shared), and the leaves the group's G samples, each a complete trajectory with
its reward. A flat group is the tree that branches once, at the prompt.

Where a leaf's nodes lie in it: `trajectory["tree"] = {"path": [c1, ..., cd], "starts": [[seg, off], ...],
"multiplicity": m}`. `path` names the child taken at each depth (the leaf is node path, its ancestors the
prefixes of path, the root ()); `starts[k]` is the (segment, token offset) in the leaf's own token stream where
its depth-(k+1) node begins; a node runs up to its child's start (or the leaf's end). Positions compare as (segment,
offset) pairs, so a node may span a self-summary boundary. `multiplicity` m > 1 marks an episode that ended before
the branch point below it: its b·b'·... continuations would all be the empty one with the same reward, so it
stands for m identical leaves (`TreeConfig` in `tree_harness`). G = Σ m over the leaves.

The estimator. With r_ℓ, m_ℓ the reward and multiplicity of leaf ℓ, for every node n:

  N(n) = Σ_{ℓ under n} m_ℓ                       leaves that share n's tokens
  V(n) = Σ_{ℓ under n} m_ℓ r_ℓ / N(n)            mean reward of the leaves below n
  A(n) = V(n) − mean_{s ∈ siblings(n) ∪ {n}} V(s)    scored against the other continuations of its parent

Each generated token of node n is trained once, on the row of its *owner* (the first leaf under n), with advantage
A(n) and loss weight N(n). That is exactly the sum, over the G leaves, of each leaf's own per-token REINFORCE term
with its node's advantage: Σ_ℓ Σ_{t ∈ ℓ} A(node(t)) ∇log π(t) = Σ_n N(n) A(n) Σ_{t ∈ n} ∇log π(t). So the loss
over a tree equals the loss over its leaves unrolled into flat rows (shared tokens repeated, per-token advantages;
`tests/test_tree_batch.py`), computed with each shared token, importance ratio and routing once.

Why it is an unbiased gradient (up to a known constant). Every leaf is marginally a trajectory of π, and the b
children of a node are i.i.d. continuations of the same state, so V(c) is an unbiased estimate of the value of the
state after child c, and the mean of c's *other* siblings is independent of c's tokens given the parent. With that
leave-one-out baseline, A_loo(c) = V(c) − mean_{s ≠ c} V(s), Σ_n N(n) A_loo(n) ∇log π(n) / G is an unbiased
estimate of ∇E[r] (the policy-gradient theorem applied at each branch point: the expectation of each node's term
is N(n)/G times that depth's share of the exact gradient, and the N(n) of a depth sum to G). The sibling mean
includes c itself, and exactly A(c) = (b − 1)/b · A_loo(c) for a node with b children (the GRPO/RLOO relation),
so with a uniform fan-out b_k at depth k the estimator's expectation is Σ_k (b_k − 1)/b_k · (depth k's part of the
exact gradient): the exact gradient times (b − 1)/b when every branch point has the same fan-out b
(`test_tree.py::test_monte_carlo_bandit_matches_exact_gradient`). A node with one child gets A = 0 (nothing to
compare it with). For the flat group (one branch point, at the prompt, b = G) A is reward − group mean:
`composer_jax.rl.losses.group_advantages` exactly.

Self-summaries: a node's tokens are the generated tokens between its start and its end in the leaf's stream,
whatever segment they are in; the summary that closes a segment is generated and credited with the node it falls
in, and the next segment's copy of it is prompt (never trained). A branch that crosses a summary boundary is
credited like any other: every one of its generated tokens, before and after the summary, gets A(n).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

Path = tuple[int, ...]
Pos = tuple[int, int]   # (segment, token offset) in a leaf's token stream


def node_name(path: Path) -> str:
  return "root" if not path else "node " + "/".join(map(str, path))


@dataclasses.dataclass
class Node:
  """One node: its leaves (indices into the group), where it starts, its children, and its credit."""
  leaves: list[int]
  start: Pos | None                  # None for the root
  children: list[Path] = dataclasses.field(default_factory=list)
  count: float = 0.0                 # N(n)
  value: float = 0.0                 # V(n)
  advantage: float = 0.0             # A(n)

  @property
  def owner(self) -> int:
    return self.leaves[0]


@dataclasses.dataclass
class Tree:
  """A group's tree: leaf paths, starts and multiplicities, and every node (keyed by path; the root is ())."""
  paths: list[Path]
  starts: list[list[Pos]]
  multiplicity: list[int]
  nodes: dict[Path, Node]

  @property
  def size(self) -> float:
    """G: the leaves the group counts (multiplicities included)."""
    return self.nodes[()].count


def is_tree_group(trajectories: Sequence[dict]) -> bool:
  """True if the group was sampled as a tree (its trajectories carry a `tree` spec); mixing is an error."""
  has = [t.get("tree") is not None for t in trajectories]
  if any(has) and not all(has):
    raise ValueError(f"group of task {trajectories[0].get('task_id')!r}: trajectories {has.index(False)} and "
                     f"{has.index(True)} disagree on whether the group is a tree (only some carry a 'tree' spec)")
  return bool(has) and has[0]


def _spec(traj: dict, i: int, flat: bool) -> tuple[Path, list[Pos], int]:
  if flat:   # leaf i of a flat group: child i of the root, from the very start (the prompt generates nothing)
    return (i,), [(0, 0)], 1
  spec = traj["tree"]
  where = f"trajectory {i} (task {traj.get('task_id')!r})"
  try:
    path = tuple(int(c) for c in spec["path"])
    starts = [(int(s), int(o)) for s, o in spec["starts"]]
    m = int(spec.get("multiplicity", 1))
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{where}: malformed tree spec {spec!r} ({e}); want path, starts, multiplicity") from e
  if not path or len(starts) != len(path) or m < 1:
    raise ValueError(f"{where}: tree spec needs a non-empty path, one start per depth and multiplicity >= 1, got "
                     f"path={list(path)} starts={starts} multiplicity={m}")
  segs = traj["segments"]
  for k, (s, o) in enumerate(starts):
    if not (0 <= s < len(segs) and 0 <= o <= len(segs[s]["tokens_T"])) or (k and starts[k - 1] > (s, o)):
      raise ValueError(f"{where}: {node_name(path[:k + 1])} starts at {(s, o)}, outside its token stream "
                       f"({len(segs)} segments) or before its parent")
  return path, starts, m


def _prefix(traj: dict, end: Pos) -> list[np.ndarray]:
  """Tokens and gen mask of a leaf's stream before position `end`, segment by segment."""
  s, o = end
  out = []
  for i in range(s + 1):
    seg = traj["segments"][i]
    cut = o if i == s else len(seg["tokens_T"])
    out += [np.asarray(seg["tokens_T"][:cut]), np.asarray(seg["gen_mask_T"][:cut])]
  return out


def build(trajectories: Sequence[dict]) -> Tree:
  """The group's tree from its leaves' specs (a group without specs is the flat tree), validated and scored.

  Raises:
    ValueError naming the trajectory or node: a malformed spec, two leaves at one path, a leaf that is another's
    ancestor, children that start at different points, or leaves that disagree on a token they share.
  """
  if not trajectories:
    raise ValueError("a tree needs at least one leaf")
  flat = not is_tree_group(trajectories)
  specs = [_spec(t, i, flat) for i, t in enumerate(trajectories)]
  paths, starts, mult = (list(x) for x in zip(*specs, strict=True))
  nodes: dict[Path, Node] = {(): Node([], None)}
  for i, (path, st, _) in enumerate(specs):
    nodes[()].leaves.append(i)
    for k in range(1, len(path) + 1):
      node = nodes.get(path[:k])
      if node is None:
        node = nodes[path[:k]] = Node([], st[k - 1])
        nodes[path[:k - 1]].children.append(path[:k])
      elif node.start != st[k - 1]:
        raise ValueError(f"{node_name(path[:k])}: trajectories {node.owner} and {i} disagree on where it starts "
                         f"({node.start} vs {st[k - 1]})")
      node.leaves.append(i)
  for i, path in enumerate(paths):
    if nodes[path].children or len(nodes[path].leaves) > 1:
      raise ValueError(f"{node_name(path)}: trajectory {i} ends there but other trajectories "
                       f"{[j for j in nodes[path].leaves if j != i]} pass through or end at the same node")
  for path, node in nodes.items():
    branch_points = {nodes[c].start for c in node.children}
    if len(branch_points) > 1:
      raise ValueError(f"{node_name(path)}: its children start at different points {sorted(branch_points)}; "
                       "all branches of a node continue from the same state")
    if not node.children:
      continue
    shared = _prefix(trajectories[node.owner], branch_points.pop())
    for i in node.leaves[1:]:
      mine = _prefix(trajectories[i], nodes[paths[i][:len(path) + 1]].start)
      if len(mine) != len(shared) or any(not np.array_equal(a, b) for a, b in zip(mine, shared, strict=True)):
        raise ValueError(f"{node_name(path)}: trajectory {i} differs from trajectory {node.owner} on the tokens "
                         "they share before its branches (a fork must continue from the exact shared context)")
  tree = Tree(paths, starts, mult, nodes)
  _score(tree, [float(t["reward"]) for t in trajectories])
  return tree


def _score(tree: Tree, rewards: list[float]) -> None:
  """Fills N, V (bottom-up over leaves) and A (against the siblings) of every node."""
  for node in tree.nodes.values():
    w = np.asarray([tree.multiplicity[i] for i in node.leaves], np.float64)
    node.count = float(w.sum())
    node.value = float(np.dot(w, [rewards[i] for i in node.leaves]) / w.sum())
  for node in tree.nodes.values():
    if node.children:
      base = float(np.mean([tree.nodes[c].value for c in node.children]))
      for c in node.children:
        tree.nodes[c].advantage = tree.nodes[c].value - base


def token_credit(trajectories: Sequence[dict], tree: Tree | None = None) -> list[list[dict[str, np.ndarray]]]:
  """Per leaf, per segment: `advantage_T` (A of the token's node), `weight_T` (its N) and `train_T` (1 on the
  generated tokens this leaf's row trains: those of the nodes it owns).

  Raises ValueError if a leaf generated tokens before its first node (the root is the prompt).
  """
  tree = tree or build(trajectories)
  out = []
  for i, traj in enumerate(trajectories):
    path, starts = tree.paths[i], tree.starts[i]
    rows = []
    for s, seg in enumerate(traj["segments"]):
      T = len(seg["tokens_T"])
      depth_T = np.zeros(T, np.int64)   # 0: the root (prompt); k: the depth-k node on this leaf's path
      for k, (ks, ko) in enumerate(starts):
        if s >= ks:
          depth_T[(ko if s == ks else 0):] = k + 1
      gen_T = np.asarray(seg["gen_mask_T"]) > 0
      if np.any(gen_T & (depth_T == 0)):
        raise ValueError(f"trajectory {i} (task {traj.get('task_id')!r}) segment {s}: generated tokens before its "
                         f"first node starts at {starts[0]} (the root is the prompt)")
      on_path = [tree.nodes[path[:k]] for k in range(len(path) + 1)]
      adv = np.asarray([n.advantage for n in on_path])[depth_T]
      weight = np.asarray([n.count for n in on_path])[depth_T]
      owned = np.asarray([n.owner == i for n in on_path])[depth_T]
      rows.append({"advantage_T": adv.astype(np.float32), "weight_T": weight.astype(np.float32),
                   "train_T": (gen_T & owned).astype(np.float32)})
    out.append(rows)
  return out


def group_rows(trajectories: Sequence[dict]) -> list[tuple[int, int]]:
  """(trajectory, segment) of each training row a group needs, in order: every segment of a flat group; of a tree
  group's leaves, the segments that train some token, and each leaf's last one (which carries its reward). A leaf's
  segment before the branch point is context only, and its owner's copy is the one trained."""
  if not is_tree_group(trajectories):
    return [(ti, si) for ti, t in enumerate(trajectories) for si in range(len(t["segments"]))]
  credit = token_credit(trajectories)
  return [(ti, si) for ti, t in enumerate(trajectories) for si, c in enumerate(credit[ti])
          if c["train_T"].any() or si == len(t["segments"]) - 1]


def shared_tokens(tree: Tree, i: int, j: int, segment: int) -> int | None:
  """Tokens at the start of segment `segment` that leaves i and j share by construction (the stream before the
  point where their paths part): up to that point in its own segment, none after it, None (all) before it."""
  c = next((k for k, (a, b) in enumerate(zip(tree.paths[i], tree.paths[j])) if a != b), None)
  if c is None:
    raise ValueError(f"leaves {i} and {j} are at one path {node_name(tree.paths[i])}")
  s, o = tree.starts[i][c]
  return None if segment < s else o if segment == s else 0
