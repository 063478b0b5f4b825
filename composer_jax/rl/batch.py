"""Consumed trajectory groups → one fixed-shape RL batch (numpy), so the jitted step compiles once.

Letters: B rows, L length, Lm MoE layers, K experts per token.

One row per segment (context window) of a trajectory, right-padded to L; groups are never split (the queue's
`poll(max_rows=B)` hands over whole groups that fit). Fields:

  tokens         int32 [B, L]      segment_ids int32 [B, L] (1 on real tokens, 0 padding)   positions int32 [B, L]
  gen_mask       f32   [B, L]      1 where the model generated the token (the loss mask; position 0 never)
  inf_logprobs   f32   [B, L]      the engine's logprob of each generated token
  routing        int32 [Lm, B, L, K]  experts the engine used at each position, −1 where not recorded
  reward         f32 [B]   passed f32 [B]   group int32 [B]   first f32 [B] (first row of its trajectory)
  valid          f32 [B]   is_cap f32 [B] (importance-ratio truncation)   staleness int32 [B]
  traj_gen_tokens f32 [B]  generated tokens of the whole trajectory (for the length metric; counted on `first`)

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


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """The fixed batch shape and how rows are weighted."""
  rows: int                          # B
  length: int                        # L
  n_moe_layers: int                  # Lm (routing rows); 0 for a dense model
  top_k: int                         # K
  is_cap: float = 2.0                # importance-ratio truncation for groups within the staleness bound
  stale_is_cap: float | None = None  # for groups kept beyond it (policy 'keep'); None: same as is_cap

  def __post_init__(self):
    if self.rows < 1 or self.length < 2:
      raise ValueError(f"need rows >= 1 and length >= 2, got {self.rows=} {self.length=}")


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
  B, L, Lm, K = cfg.rows, cfg.length, cfg.n_moe_layers, cfg.top_k
  n_rows = sum(len(t["segments"]) for g in groups for t in g)
  if n_rows > B:
    raise ValueError(f"{len(groups)} groups need {n_rows} rows but the batch has {B}; poll with max_rows={B}")
  out = {"tokens": np.zeros((B, L), np.int32), "segment_ids": np.zeros((B, L), np.int32),
         "positions": np.zeros((B, L), np.int32), "gen_mask": np.zeros((B, L), np.float32),
         "inf_logprobs": np.zeros((B, L), np.float32), "routing": np.full((Lm, B, L, K), -1, np.int32),
         "reward": np.zeros(B, np.float32), "passed": np.zeros(B, np.float32), "group": np.zeros(B, np.int32),
         "first": np.zeros(B, np.float32), "valid": np.zeros(B, np.float32),
         "is_cap": np.full(B, cfg.is_cap, np.float32), "staleness": np.zeros(B, np.int32),
         "traj_gen_tokens": np.zeros(B, np.float32)}
  stale_cap = cfg.is_cap if cfg.stale_is_cap is None else cfg.stale_is_cap
  i = 0
  for gi, group in enumerate(groups):
    for traj in group:
      n_gen = sum(int(np.sum(s["gen_mask_T"])) for s in traj["segments"])
      for si, seg in enumerate(traj["segments"]):
        T = len(seg["tokens_T"])
        if T > L:
          raise ValueError(f"task {traj.get('task_id')!r} segment {si} has {T} tokens, more than the batch "
                           f"length {L}: raise the length or cap rollout contexts")
        out["tokens"][i, :T] = seg["tokens_T"]
        out["segment_ids"][i, :T] = 1
        out["positions"][i, :T] = np.arange(T)
        out["gen_mask"][i, :T] = seg["gen_mask_T"]
        out["gen_mask"][i, 0] = 0.0
        out["inf_logprobs"][i, :T] = seg["logprobs_T"]
        routed = seg.get("routed_TxNxK")
        if routed is not None and Lm:
          routed = np.asarray(routed)
          if routed.shape[1:] != (Lm, K):
            raise ValueError(f"task {traj.get('task_id')!r} routing has {routed.shape[1:]} (layers, top_k) per "
                             f"token, the model has {(Lm, K)}")
          out["routing"][:, i, :T] = routed.transpose(1, 0, 2)
        out["reward"][i] = traj["reward"]
        out["passed"][i] = passed(traj)
        out["group"][i] = gi
        out["first"][i] = float(si == 0)
        out["valid"][i] = 1.0
        if over_stale is not None and over_stale[gi]:
          out["is_cap"][i] = stale_cap
        out["staleness"][i] = 0 if staleness is None else staleness[gi]
        out["traj_gen_tokens"][i] = n_gen
        i += 1
  if not math.isfinite(float(out["reward"].sum())):
    raise ValueError("non-finite reward in the batch")
  return out


def from_consumed(consumed: Sequence[Any], cfg: BatchConfig) -> dict[str, np.ndarray]:
  """`make_batch` from `rollout.queue.ConsumedGroup`s (staleness and the over-stale flag come along)."""
  return make_batch([c.trajectories() for c in consumed], cfg, staleness=[c.staleness for c in consumed],
                    over_stale=[c.over_stale for c in consumed])
