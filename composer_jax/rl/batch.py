"""Consumed trajectory groups → one fixed-shape RL batch (numpy), so the jitted step compiles once.

Letters: S sequences, R rows, L length, Lm MoE layers, K experts per token.

A *sequence* is one segment (context window) of a trajectory; a step holds up to S of them (`BatchConfig.rows`).
Unpacked (`pack_rows=0`), each sequence has a row of its own, right-padded to L (R = S). Packed (`pack_rows=R`),
the sequences are laid end to end into R rows (first fit, each group's longest first; `Packer`), each with its own
`segment_ids` value and positions from 0, so attention never crosses two sequences; this saves the padding of
short segments (a level-1 episode is ~150 of a 496-token row). Groups are never split (the queue's
`poll(max_rows=S, fits=...)` hands over whole groups that fit). Fields:

  tokens         int32 [R, L]   segment_ids int32 [R, L] (1, 2, ... per sequence of a row; 0 padding)
  positions      int32 [R, L]   seq int32 [R, L] (the sequence each token belongs to, an index into the [S] fields)
  gen_mask       f32   [R, L]   1 where the model generated the token (the loss mask; a sequence's first never)
  inf_logprobs   f32   [R, L]   the engine's logprob of each generated token
  routing        int32 [Lm, R, L, K]  experts the engine used at each position, −1 where not recorded
  reward         f32 [S]   passed f32 [S]   group int32 [S]   first f32 [S] (first segment of its trajectory)
  valid          f32 [S]   is_cap f32 [S] (importance-ratio truncation)   staleness int32 [S]
  traj_gen_tokens f32 [S]  generated tokens of the whole trajectory (for the length metric; counted on `first`)

A batch without `seq` (built by hand) is read as unpacked: sequence i is row i.

Tree groups (`rollout.tree`; a group whose trajectories carry a `tree` spec) are a group's leaves, each a whole
trajectory. Their credit is per token, so a batch that holds any tree group has two more fields, and the step
uses them instead of its group advantages:

  token_adv      f32   [R, L]   the advantage of each token's node (`rollout.tree.token_credit`)
  loss_weight    f32   [R, L]   the number of leaves that share the token (1 for a flat group's tokens)

and `gen_mask` is 1 only on the tokens a row trains: a node shared by several leaves is trained once, on its first
leaf's row, with its leaf count as weight (the other rows hold it as context). A leaf's segment that trains nothing
is left out (e.g. a whole segment before the branch point; only its last segment, which carries its reward, is
always kept), so a prefix shared across a self-summary boundary is not stored twice. Flat groups in such a batch
get reward − group mean (the same numbers; `adv_std` is not available for trees). A batch of flat groups only is
unchanged.

A prefix inside the segment where the branches start is, by default, repeated in each branch's row as context
(attention separates whole sequences, `segment_ids`). With `share_prefix` it is stored once: a tree group's rows of
one segment index are laid out as one packed sequence (`row_pieces`: in path order, each leaf's row
after the prefix it shares with the one before; cut into several where it would pass L), and three more fields
say what each token sees and follows:

  branch         int32 [R, L]   which member of its packed sequence stored the token (0 elsewhere)
  branch_end     int32 [R, L]   one past the last member whose stream holds it (1 elsewhere): a query of member b
                                sees key k iff b < branch_end[k], besides the causal and segment conditions
                                (`model.attention.branch_mask`)
  prev           int32 [R, L]   the row position of the token's predecessor in its own stream (the logprob of a
                                branch's first token is read off the prefix's last hidden state); itself if none

Positions continue the stream (a branch's first token has its offset in the leaf's segment), a shared token's
routing and engine logprob are those of the copy stored, and its training flag is set if any member that holds
it owns it, so the loss, its gradients and every statistic of the step equal the duplicated rows' (the routing
mismatch rate counts each stored position once; `tests/test_tree_shared_prefix.py`). `seq` of a shared token is
the member that stored it. It needs the "whole" or "tiled" attention kernel on one device or data/expert axes (the
ring and the Pallas kernel take segment ids, not a mask); the MTP drafter's self-distillation skips the tokens
whose row predecessors are not their stream predecessors (`rl.step.mtp_gen_mask`).

Routing convention: `routing[:, i, p]` are the experts the engine used when token p was *input* at position p
(what `model.hidden_states(routing=...)` replays, and SGLang's `routed_experts` layout). Engines that report prefill
routing fill the prompt and tool-output positions too; positions never recorded are −1, and the RL step fills the
ones a trained token depends on with the trainer's own routing (`rl.step.replay_routing`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout import tree as tree_lib


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """The fixed batch shape and how rows are weighted."""
  rows: int                          # S: sequences (segments) a step holds
  length: int                        # L
  n_moe_layers: int                  # Lm (routing rows); 0 for a dense model
  top_k: int                         # K
  pack_rows: int = 0                 # R: pack the sequences into this many rows (0: a row each, R = S)
  is_cap: float = 2.0                # importance-ratio truncation for groups within the staleness bound
  stale_is_cap: float | None = None  # for groups kept beyond it (policy 'keep'); None: same as is_cap
  share_prefix: bool = False         # a tree group's shared prefixes stored once (`branch`, `branch_end`, `prev`)

  def __post_init__(self):
    if self.rows < 1 or self.length < 2 or not 0 <= self.pack_rows <= self.rows:
      raise ValueError(f"need rows >= 1, length >= 2 and 0 <= pack_rows <= rows, got {self.rows=} "
                       f"{self.length=} {self.pack_rows=}")


# The batch's fields, described once (`make_batch` fills them, `rl.placement.batch_shardings` places them, the scale
# plan builds abstract batches of them): per token [R, L], per sequence [S], a tree group's per-token credit [R, L], and
# `routing` [Lm, R, L, K].
PER_TOKEN = {"tokens": np.int32, "segment_ids": np.int32, "positions": np.int32, "seq": np.int32,
             "gen_mask": np.float32, "inf_logprobs": np.float32}
PER_SEQUENCE = {"reward": np.float32, "passed": np.float32, "group": np.int32, "first": np.float32,
                "valid": np.float32, "is_cap": np.float32, "staleness": np.int32, "traj_gen_tokens": np.float32}
TREE_PER_TOKEN = {"token_adv": np.float32, "loss_weight": np.float32}
SHARED_PREFIX_PER_TOKEN = {"branch": np.int32, "branch_end": np.int32, "prev": np.int32}   # `share_prefix` trees


def per_token_fields(trees: bool = False, share_prefix: bool = False) -> dict[str, Any]:
  """{field: dtype} of a batch's [R, L] fields: with tree groups, and with their shared prefixes stored once."""
  return PER_TOKEN | (TREE_PER_TOKEN if trees else {}) | (SHARED_PREFIX_PER_TOKEN if share_prefix else {})


def field_shapes(rows: int, length: int, sequences: int, n_moe_layers: int, top_k: int, trees: bool = False,
                 share_prefix: bool = False) -> dict[str, tuple[tuple[int, ...], Any]]:
  """{field: (shape, dtype)} of a batch of `rows` x `length` tokens holding `sequences` sequences."""
  out = {k: ((rows, length), d) for k, d in per_token_fields(trees, share_prefix).items()}
  out |= {k: ((sequences,), d) for k, d in PER_SEQUENCE.items()}
  out["routing"] = ((n_moe_layers, rows, length, top_k), np.int32)
  return out


def pieces(trajectories: Sequence[dict], cfg: BatchConfig | None = None) -> list[list[tuple[int, int]]]:
  """The packed sequences a group's rows are stored as: a sequence each, or with `cfg.share_prefix` a tree
  group's `row_pieces` (members: (index into `group_rows`, first token offset stored))."""
  rows = tree_lib.group_rows(trajectories)
  if cfg is not None and cfg.share_prefix and tree_lib.is_tree_group(trajectories):
    return row_pieces(trajectories, rows, cfg.length)
  return [[(k, 0)] for k in range(len(rows))]


def row_pieces(trajectories: Sequence[dict], rows: Sequence[tuple[int, int]], length: int,
               tree: tree_lib.Tree | None = None) -> list[list[tuple[int, int]]]:
  """How a tree group's rows (`rollout.tree.group_rows`) are stored with each shared prefix once: pieces of rows,
  each laid out as one packed sequence, as (index into `rows`, first token offset it stores) per member.

  The rows of one segment index go in path order: the first member of a piece stores its whole segment, each next
  one only its tokens after the prefix it shares with the member before it (in path order that is the longest
  prefix it shares with any earlier member, and every shorter one is a prefix of it). A piece is cut where the
  next member would take it past `length` tokens; that member starts a piece of its own, its prefix repeated.
  """
  tree = tree or tree_lib.build(trajectories)
  by_segment: dict[int, list[int]] = {}
  for k, (_, si) in enumerate(rows):
    by_segment.setdefault(si, []).append(k)
  out = []
  for si, ks in sorted(by_segment.items()):
    ks.sort(key=lambda k: tree.paths[rows[k][0]])
    piece, used = [], 0
    for k in ks:
      T = len(trajectories[rows[k][0]]["segments"][si]["tokens_T"])
      start = 0
      if piece:
        before = rows[piece[-1][0]][0]
        shared = tree_lib.shared_tokens(tree, before, rows[k][0], si)
        start = min(T, len(trajectories[before]["segments"][si]["tokens_T"]), T if shared is None else shared)
      if piece and used + T - start > length:
        out.append(piece)
        piece, used, start = [], 0, 0
      piece.append((k, start))
      used += T - start
    out.append(piece)
  return out


def segment_lengths(trajectories: Sequence[dict], cfg: BatchConfig | None = None) -> list[int]:
  """Tokens of each packed sequence a group contributes (`pieces`), in batch order."""
  return _lengths(trajectories, tree_lib.group_rows(trajectories), pieces(trajectories, cfg))


def _lengths(trajectories: Sequence[dict], rows: Sequence[tuple[int, int]], pieces_: Sequence) -> list[int]:
  """Tokens of each of a group's `pieces_` (of its `rows`, `tree.group_rows`)."""
  seg_len = lambda k: len(trajectories[rows[k][0]]["segments"][rows[k][1]]["tokens_T"])  # noqa: E731
  return [sum(seg_len(k) - start for k, start in piece) for piece in pieces_]


class Packer:
  """First-fit packing of whole groups' segments into `n_rows` rows of `length` tokens, at most `max_sequences`.

  Each group's segments are placed longest first into the first row with room; `add` either places all of a
  group's segments or none. `make_batch` and the trainer's step assembly (`rl.sources.take_groups`) run the same
  packer in the same group order, so a step that `add` accepted always builds.
  """

  def __init__(self, n_rows: int, length: int, max_sequences: int):
    self.length, self.max_sequences = length, max_sequences
    self.free = [length] * n_rows      # tokens left in each row
    self.n_sequences = 0

  def add(self, lengths: Sequence[int]) -> list[tuple[int, int]] | None:
    """(row, offset) of each segment (in the given order), or None (nothing placed) if the group does not fit."""
    if self.n_sequences + len(lengths) > self.max_sequences:
      return None
    free, out = list(self.free), [None] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
      row = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
      if row is None:
        return None
      out[i] = (row, self.length - free[row])
      free[row] -= lengths[i]
    self.free, self.n_sequences = free, self.n_sequences + len(lengths)
    return out


def passed(traj: dict[str, Any]) -> float:
  """1.0 if the task was solved: `metrics['solved']` (the harness's field), else reward > 0."""
  m = traj.get("metrics") or {}
  return float(m["solved"]) if "solved" in m else float(traj["reward"] > 0)


def make_batch(groups: Sequence[Sequence[dict]], cfg: BatchConfig, *, staleness: Sequence[int] | None = None,
               over_stale: Sequence[bool] | None = None) -> dict[str, np.ndarray]:
  """Builds the batch from groups of trajectory dicts (`Trajectory.to_dict()` layout).

  Args:
    groups: each a list of trajectories of one task (e.g. `ConsumedGroup.trajectories()`).
    cfg: batch shape.
    staleness: per group, trainer version − policy version (stored for metrics).
    over_stale: per group, True if it is beyond the staleness bound (gets `stale_is_cap`).
  Returns:
    dict of numpy arrays described in the module docstring.
  """
  S, L, Lm, K = cfg.rows, cfg.length, cfg.n_moe_layers, cfg.top_k
  rows = [tree_lib.group_rows(g) for g in groups]
  trees = any(tree_lib.is_tree_group(g) for g in groups)
  n_seq = sum(map(len, rows))
  if n_seq > S:
    raise ValueError(f"{len(groups)} groups need {n_seq} rows but the batch has {S}; poll with max_rows={S}")
  for g in groups:
    for traj in g:
      for si, seg in enumerate(traj["segments"]):
        if len(seg["tokens_T"]) > L:
          raise ValueError(f"task {traj.get('task_id')!r} segment {si} has {len(seg['tokens_T'])} tokens, more "
                           f"than the batch length {L}: raise the length or cap rollout contexts")
  group_pieces = [pieces(g, cfg) for g in groups]
  # (row, offset) of each piece, in batch order
  places = _place([_lengths(g, r, p) for g, r, p in zip(groups, rows, group_pieces, strict=True)], cfg)
  # R rows: pack_rows, or S for a lone group too large for them (the step's second compiled shape)
  R = cfg.pack_rows if cfg.pack_rows and all(r < cfg.pack_rows for r, _ in places) else S
  share = trees and cfg.share_prefix
  out = {k: np.zeros(shape, dtype) for k, (shape, dtype) in field_shapes(R, L, S, Lm, K, trees, share).items()}
  out["routing"][:] = -1
  out["is_cap"][:] = cfg.is_cap
  if share:
    out["branch_end"][:] = 1
    out["prev"][:] = np.arange(L, dtype=np.int32)
  stale_cap = cfg.is_cap if cfg.stale_is_cap is None else cfg.stale_is_cap
  seg_id = {place: n + 1 for r in range(R)   # a row's sequences are numbered left to right from 1
            for n, place in enumerate(sorted(p for p in places if p[0] == r))}
  i = p = 0
  for gi, (group, group_rows_, pieces_) in enumerate(zip(groups, rows, group_pieces, strict=True)):
    credit = tree_lib.token_credit(group) if trees else None
    for piece in pieces_:
      _write_piece(out, group, group_rows_, piece, places[p], seg_id[places[p]], i, credit, cfg)
      p += 1
    seen = set()
    for ti, _ in group_rows_:
      traj = group[ti]
      out["reward"][i] = traj["reward"]
      out["passed"][i] = passed(traj)
      out["group"][i] = gi
      out["first"][i] = float(ti not in seen)   # a trajectory's first row in the batch
      seen.add(ti)
      out["valid"][i] = 1.0
      if over_stale is not None and over_stale[gi]:
        out["is_cap"][i] = stale_cap
      out["staleness"][i] = 0 if staleness is None else staleness[gi]
      out["traj_gen_tokens"][i] = sum(int(np.sum(s["gen_mask_T"])) for s in traj["segments"])
      i += 1
  if not math.isfinite(float(out["reward"].sum())):
    raise ValueError("non-finite reward in the batch")
  return out


def _write_piece(out: dict, group: Sequence[dict], rows: Sequence[tuple[int, int]], piece: Sequence[tuple[int, int]],
                 place: tuple[int, int], seg_id: int, base: int, credit, cfg: BatchConfig) -> None:
  """Writes one packed sequence: its members' tokens after their shared prefixes, from `place` on.

  Member m's segment is stored from its `start` on; its tokens before that are member m − 1's (the prefix they
  share), so `where[j]` (the row position of member m's token j) continues member m − 1's map. The shared tokens'
  training flags are OR-ed over the members that hold them (a node is trained on its owner's row, which may be
  any of them); `branch_end` of a token is one past the last member whose stream holds it, so member m's tokens
  see exactly their own stream (`model.attention.branch_mask`).
  """
  r, o = place
  where_prev = None
  for m, (k, start) in enumerate(piece):
    ti, si = rows[k]
    seg = group[ti]["segments"][si]
    T = len(seg["tokens_T"])
    where = np.empty(T, np.int64)
    if start:
      where[:start] = where_prev[:start]
    where[start:] = o + np.arange(T - start)
    new = where[start:]
    out["tokens"][r, new] = seg["tokens_T"][start:]
    out["segment_ids"][r, new] = seg_id
    out["positions"][r, new] = np.arange(start, T)
    out["seq"][r, new] = base + k
    out["inf_logprobs"][r, new] = seg["logprobs_T"][start:]
    if credit is None:
      out["gen_mask"][r, new] = seg["gen_mask_T"][start:]
    else:
      c = credit[ti][si]
      trained = c["train_T"] > 0
      out["gen_mask"][r, where] = np.maximum(out["gen_mask"][r, where], c["train_T"])
      for name, src in (("token_adv", "advantage_T"), ("loss_weight", "weight_T")):
        out[name][r, new] = c[src][start:]
        out[name][r, where[trained]] = c[src][trained]
    if start == 0:
      out["gen_mask"][r, o] = 0.0   # a sequence's first token is never trained (nothing before it)
    if "branch" in out:
      out["branch"][r, new] = m
      out["branch_end"][r, where] = m + 1
      out["prev"][r, new] = where[np.maximum(np.arange(start, T) - 1, 0)]
      out["prev"][r, where[0]] = where[0]
    routed = seg.get("routed_TxNxK")
    Lm, K = cfg.n_moe_layers, cfg.top_k
    if routed is not None and Lm:
      routed = np.asarray(routed)
      if routed.shape[1:] != (Lm, K):
        raise ValueError(f"task {group[ti].get('task_id')!r} routing has {routed.shape[1:]} (layers, top_k) per "
                         f"token, the model has {(Lm, K)}")
      out["routing"][:, r, new] = routed[start:].transpose(1, 0, 2)
    where_prev, o = where, o + T - start


def _place(lengths: Sequence[Sequence[int]], cfg: BatchConfig) -> list[tuple[int, int]]:
  """(row, offset) of every sequence, given each group's piece lengths: a row each unpacked; packed, `Packer` into
  `pack_rows` rows, or into S rows when the step is one group too large for them (`take_groups` gives such a group
  a step of its own)."""
  n_pieces = sum(map(len, lengths))
  if not cfg.pack_rows:
    return [(i, 0) for i in range(n_pieces)]
  for n_rows in (cfg.pack_rows, cfg.rows):
    packer, places = Packer(n_rows, cfg.length, cfg.rows), []
    for ls in lengths:
      got = packer.add(ls)
      if got is None:
        break
      places += got
    else:
      return places
  raise ValueError(f"{len(lengths)} groups do not pack into {cfg.pack_rows} rows of {cfg.length} tokens; take the "
                   "step's groups with rl.sources.take_groups (it checks each group with the same Packer)")


def from_consumed(consumed: Sequence[Any], cfg: BatchConfig) -> dict[str, np.ndarray]:
  """`make_batch` from `rollout.queue.ConsumedGroup`s (staleness and the over-stale flag come along)."""
  return make_batch([c.trajectories() for c in consumed], cfg, staleness=[c.staleness for c in consumed],
                    over_stale=[c.over_stale for c in consumed])
