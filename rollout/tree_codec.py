"""A tree group stored once: each leaf keeps only what it does not share with an earlier leaf.

The leaves of a tree group (`rollout.tree`) repeat their shared prefix: every leaf is a whole trajectory, and a
trunk of a few turns (tokens, logprobs, versions, turns and routing, the largest array) would be stored once per
leaf. In the queue, leaf i keeps only its own part: the nodes on its path that an earlier leaf owns end where its
own first node starts, at (segment s, offset o), and everything before that is the same as in that earlier leaf
(the fork copied the whole record). The stored leaf drops its segments before s and the first o positions of
segment s's per-token arrays, and says where they are:

  shared_prefix = {"version": 1, "leaf": j, "until": [s, o]}     j < i: the leaf holding the prefix

`restore_prefixes` puts them back, in leaf order (so j is already whole). A leaf whose prefix differs in any field
from its donor's (it should not, but a record is never changed by storage) is stored whole. Flat groups pass
through unchanged. A reader that meets another `version` refuses the group with an error naming it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollout import tree as tree_lib

VERSION = 1
PER_TOKEN = ("tokens_T", "gen_mask_T", "logprobs_T", "versions_T", "turns_T", "routed_TxNxK")


def _cut(seg: dict, o: int, keep_tail: bool) -> dict:
  """A segment's per-token arrays from offset o on (`keep_tail`) or before it."""
  return {k: (None if v is None else (np.asarray(v)[o:] if keep_tail else np.asarray(v)[:o]))
          if k in PER_TOKEN else v for k, v in seg.items()}


def _same(a, b) -> bool:
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
    return a is not None and b is not None and np.asarray(a).dtype == np.asarray(b).dtype and \
      np.array_equal(a, b)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
  return a == b


def share_prefixes(trajectories: Sequence[dict]) -> list[dict]:
  """The group as stored: tree leaves without the prefix an earlier leaf holds (module docstring)."""
  if not tree_lib.is_tree_group(trajectories):
    return list(trajectories)
  tree = tree_lib.build(trajectories)
  out = []
  for i, traj in enumerate(trajectories):
    path = tree.paths[i]
    borrowed = [k for k in range(1, len(path) + 1) if tree.nodes[path[:k]].owner != i]
    if not borrowed:
      out.append(traj)
      continue
    j = borrowed[-1]                      # the deepest node an earlier leaf owns; leaf i's own begin after it
    donor = tree.nodes[path[:j]].owner
    s, o = tree.starts[i][j]
    segs, dsegs = traj["segments"], trajectories[donor]["segments"]
    if not (_same(segs[:s], dsegs[:s]) and _same(_cut(segs[s], o, False), _cut(dsegs[s], o, False))):
      out.append(traj)                    # not a copy of the donor's prefix: store it whole, lose nothing
      continue
    stored = [{**_cut(segs[s], o, True)}] + list(segs[s + 1:])
    out.append({**traj, "segments": stored, "shared_prefix": {"version": VERSION, "leaf": donor, "until": [s, o]}})
  return out


def restore_prefixes(trajectories: Sequence[dict]) -> list[dict]:
  """Inverse of `share_prefixes`: every leaf whole again.

  Raises:
    ValueError naming the trajectory: an unknown `shared_prefix` version, or a reference to a leaf that is not an
    earlier one of the group.
  """
  out: list[dict] = []
  for i, traj in enumerate(trajectories):
    ref = traj.get("shared_prefix")
    if ref is None:
      out.append(traj)
      continue
    if ref.get("version") != VERSION:
      raise ValueError(f"trajectory {i} (task {traj.get('task_id')!r}): shared_prefix codec version "
                       f"{ref.get('version')!r}; this reader knows version {VERSION}")
    j, (s, o) = int(ref["leaf"]), (int(x) for x in ref["until"])
    if not 0 <= j < i or s >= len(out[j]["segments"]):
      raise ValueError(f"trajectory {i} (task {traj.get('task_id')!r}): shared_prefix {ref} does not name an "
                       f"earlier leaf's segment (the group has {len(trajectories)} leaves)")
    donor, tail = out[j]["segments"], traj["segments"][0]
    head = _cut(donor[s], o, False)
    first = {k: (None if v is None else np.concatenate([head[k], v])) if k in PER_TOKEN else v
             for k, v in tail.items()}
    rest = {k: v for k, v in traj.items() if k != "shared_prefix"}
    out.append({**rest, "segments": list(donor[:s]) + [first] + list(traj["segments"][1:])})
  return out
