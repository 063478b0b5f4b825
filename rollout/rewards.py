"""Rewards: task success from hidden tests, the report's nonlinear length penalty, and behavioural terms.

  reward = task_reward
           - length_weight * C(x)                      x = output tokens, turns or tool calls (`length_unit`)
           - todo_weight * unfinished todo items at finish
           - malformed_weight * malformed tool calls (unparseable, unknown tool, bad arguments)
           - repeat_weight * repeated identical tool calls (the same name + arguments seen before: loops)
           - no_message_weight * [finished without a final message to the user]
           - lint_weight * new lint findings (ruff) in the files the agent changed

  C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)),   and its q -> 1 limit log(1 + k x) / k.

C is concave for q > 0: the first tokens cost most, so the model is pushed to be quick on easy tasks while long work
on hard ones costs relatively little more. Every term is reported in the breakdown, signed as it enters the sum.
"""

from __future__ import annotations

import dataclasses
import math

LENGTH_UNITS = ("tokens", "turns", "tool_calls")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Weights of the reward terms (0 switches a term off); see the module docstring."""
  length_weight: float = 0.0
  length_k: float = 0.01
  length_q: float = 0.5
  length_unit: str = "tokens"
  todo_weight: float = 0.05
  malformed_weight: float = 0.05
  repeat_weight: float = 0.02
  no_message_weight: float = 0.05
  lint_weight: float = 0.02

  def __post_init__(self):
    if self.length_unit not in LENGTH_UNITS:
      raise ValueError(f"length_unit {self.length_unit!r} not in {LENGTH_UNITS}")
    if self.length_k <= 0:
      raise ValueError(f"length_k must be > 0, got {self.length_k}")


def length_penalty(x: float, k: float, q: float) -> float:
  """C(x) = ((1 + k x)^(1-q) - 1) / (k (1-q)); log(1 + k x) / k when q == 1 (its limit)."""
  if x < 0:
    raise ValueError(f"length must be >= 0, got {x}")
  if k <= 0:
    raise ValueError(f"k must be > 0, got {k}")
  if abs(1.0 - q) < 1e-9:
    return math.log1p(k * x) / k
  return ((1.0 + k * x) ** (1.0 - q) - 1.0) / (k * (1.0 - q))


@dataclasses.dataclass(frozen=True)
class EpisodeStats:
  """What the reward needs to know about an episode besides the tests.

  Attributes:
    output_tokens: model-generated tokens over all segments.
    turns: model turns (summaries included).
    tool_calls: parsed tool calls (valid or not).
    malformed_calls: unparseable outputs + unknown tools + calls with bad arguments.
    repeated_calls: calls identical (name and arguments) to an earlier call in the episode.
    finished: the model called finish.
    final_message: the text it ended with (finish's message, else the last turn's plain text).
    unfinished_todos: open todo items when the episode ended.
    new_lint_findings: ruff findings added in the files it changed (after minus before, per file, floored at 0).
  """
  output_tokens: int = 0
  turns: int = 0
  tool_calls: int = 0
  malformed_calls: int = 0
  repeated_calls: int = 0
  finished: bool = False
  final_message: str = ""
  unfinished_todos: int = 0
  new_lint_findings: int = 0


def compute_reward(task_reward: float, stats: EpisodeStats, cfg: RewardConfig) -> tuple[float, dict[str, float]]:
  """The scalar reward and its breakdown (each term signed as it enters the sum).

  Args:
    task_reward: 1.0 if every required hidden test passed, else 0.0.
    stats: episode counts.
    cfg: weights.

  Returns:
    (reward, breakdown) with breakdown terms task, length, todo, malformed, repeat, no_message, lint summing to
    reward.
  """
  x = {"tokens": stats.output_tokens, "turns": stats.turns, "tool_calls": stats.tool_calls}[cfg.length_unit]
  no_message = stats.finished and not stats.final_message.strip()
  terms = {
    "task": float(task_reward),
    "length": -cfg.length_weight * length_penalty(x, cfg.length_k, cfg.length_q) if cfg.length_weight else 0.0,
    # Open todos only count against an agent that declared itself done.
    "todo": -cfg.todo_weight * (stats.unfinished_todos if stats.finished else 0),
    "malformed": -cfg.malformed_weight * stats.malformed_calls,
    "repeat": -cfg.repeat_weight * stats.repeated_calls,
    "no_message": -cfg.no_message_weight * float(no_message),
    "lint": -cfg.lint_weight * stats.new_lint_findings,
  }
  return sum(terms.values()), terms
