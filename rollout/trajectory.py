"""The trajectory record: what a rollout produced, token by token, for the queue and the RL trainer.

A trajectory is a chain of segments (a new segment starts after each self-summary). Each segment is one context:
its token stream with per-token arrays, T tokens, N MoE layers, K experts per token:

  tokens_T            int32    every token of the context, prompt included
  gen_mask_T          int8     1 where the model generated the token (train on these), 0 for environment tokens
  logprobs_T          float32  the sampler's log-probability of generated tokens (0 elsewhere)
  versions_T          int32    policy version that generated the token (-1 for environment tokens)
  turns_T             int32    turn index the token belongs to (-1 for the initial prompt); a turn is the model's
                               output plus the environment's reply that follows it
  routed_TxNxK        int32    experts the engine routed each token to as input: generated tokens from their decode
                               step, earlier tokens from the prefill of the call that first saw them (engines that
                               report prefill routing); -1 where never recorded; None for engines without routing

plus `turns` (one dict per turn: token offsets, finish reason, tool names, timings, errors). The final reward is
credited to every segment (summaries are trained too). `to_dict`/`from_dict` round-trip exactly (numpy arrays and
JSON-able metadata).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class Segment:
  """One context window of a trajectory (see the module docstring)."""
  tokens_T: np.ndarray
  gen_mask_T: np.ndarray
  logprobs_T: np.ndarray
  versions_T: np.ndarray
  turns_T: np.ndarray
  routed_TxNxK: np.ndarray | None
  prompt_len: int
  turns: list[dict[str, Any]]
  ends_with_summary: bool = False

  def __post_init__(self):
    t = len(self.tokens_T)
    for name in ("gen_mask_T", "logprobs_T", "versions_T", "turns_T"):
      if getattr(self, name).shape != (t,):
        raise ValueError(f"Segment.{name} has shape {getattr(self, name).shape}, want ({t},)")
    if self.routed_TxNxK is not None and (self.routed_TxNxK.ndim != 3 or len(self.routed_TxNxK) != t):
      raise ValueError(f"Segment.routed_TxNxK must be [{t}, N, K], got {self.routed_TxNxK.shape}")

  @property
  def n_generated(self) -> int:
    return int(self.gen_mask_T.sum())


@dataclasses.dataclass
class Trajectory:
  """A whole rollout of one task.

  Attributes:
    task_id: the task.
    segments: the context chain (>= 1).
    reward: the scalar reward credited to every segment.
    breakdown: reward terms (name -> value), including the task reward and each penalty.
    metrics: logged numbers (pass fraction, counts of tool calls / errors, timings).
    messages: the human-readable transcript (chat_format messages) of all segments.
    stop_reason: 'finish' | 'max_turns' | 'max_segments' | 'abort'.
    tree: where this trajectory's nodes lie when its group was sampled as a tree (`rollout.tree`); None in a flat
      group.
  """
  task_id: str
  segments: list[Segment]
  reward: float = 0.0
  breakdown: dict[str, float] = dataclasses.field(default_factory=dict)
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  stop_reason: str = ""
  tree: dict[str, Any] | None = None

  @property
  def n_generated(self) -> int:
    return sum(s.n_generated for s in self.segments)

  def training_rows(self) -> list[dict[str, Any]]:
    """One row per segment for a trainer: its arrays plus the trajectory's reward (credited to every segment, so
    the summaries that closed earlier segments are trained on the final outcome too)."""
    return [{"tokens_T": s.tokens_T, "gen_mask_T": s.gen_mask_T, "logprobs_T": s.logprobs_T,
             "versions_T": s.versions_T, "routed_TxNxK": s.routed_TxNxK, "reward": self.reward,
             "task_id": self.task_id, "segment": i} for i, s in enumerate(self.segments)]

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)  # deep-copies, arrays included

  @staticmethod
  def from_dict(d: dict[str, Any]) -> Trajectory:
    segments = [Segment(**{k: (np.asarray(v) if k.endswith(("_T", "_TxNxK")) and v is not None else v)
                           for k, v in s.items()}) for s in d["segments"]]
    return Trajectory(**{**d, "segments": segments})


class SegmentBuilder:
  """Accumulates one segment's token stream."""

  def __init__(self, prompt_ids: list[int]):
    self.prompt_len = len(prompt_ids)
    self.tokens, self.gen, self.logprobs, self.versions = list(prompt_ids), [0] * len(prompt_ids), \
      [0.0] * len(prompt_ids), [-1] * len(prompt_ids)
    self.turn_ids = [-1] * len(prompt_ids)
    self.routed: list[np.ndarray | None] = [None] * len(prompt_ids)
    self.routed_shape: tuple[int, int] | None = None
    self.turns: list[dict[str, Any]] = []

  def __len__(self) -> int:
    return len(self.tokens)

  def add_generated(self, ids, logprobs, routed_TxNxK, version: int, turn: int, prompt_routed_PxNxK=None) -> None:
    """Appends one engine call's output; `prompt_routed_PxNxK` (that call's prefill routing of the P tokens before
    it) fills positions not recorded yet — a token keeps the routing it had when the engine first ran it."""
    if prompt_routed_PxNxK is not None:
      if len(prompt_routed_PxNxK) > len(self.tokens):
        raise ValueError(f"prompt routing covers {len(prompt_routed_PxNxK)} positions, the context has "
                         f"{len(self.tokens)}")
      self.routed_shape = prompt_routed_PxNxK.shape[1:]
      for i, r in enumerate(np.asarray(prompt_routed_PxNxK, np.int32)):
        if self.routed[i] is None or self.routed[i].min() < 0:   # -1 rows: a token the engine never fed back
          self.routed[i] = r
    self.tokens += [int(i) for i in ids]
    self.gen += [1] * len(ids)
    self.logprobs += [float(x) for x in logprobs]
    self.versions += [version] * len(ids)
    self.turn_ids += [turn] * len(ids)
    if routed_TxNxK is not None:
      self.routed_shape = routed_TxNxK.shape[1:]
      self.routed += list(np.asarray(routed_TxNxK, np.int32))
    else:
      self.routed += [None] * len(ids)

  def add_environment(self, ids, turn: int) -> None:
    self.tokens += [int(i) for i in ids]
    self.gen += [0] * len(ids)
    self.logprobs += [0.0] * len(ids)
    self.versions += [-1] * len(ids)
    self.turn_ids += [turn] * len(ids)
    self.routed += [None] * len(ids)

  def build(self, ends_with_summary: bool) -> Segment:
    routed = None
    if self.routed_shape is not None:
      fill = np.full(self.routed_shape, -1, np.int32)
      routed = np.stack([fill if r is None else r for r in self.routed]).astype(np.int32)
    return Segment(np.asarray(self.tokens, np.int32), np.asarray(self.gen, np.int8),
                   np.asarray(self.logprobs, np.float32), np.asarray(self.versions, np.int32),
                   np.asarray(self.turn_ids, np.int32), routed, self.prompt_len, self.turns, ends_with_summary)
