"""Rewards: task success from hidden tests, the report's nonlinear length penalty, and behavioural terms.

  reward = task_reward
           - length_weight * C(x)                      x = output tokens, turns or tool calls (`length_unit`)
           - todo_weight * todo items still open when the episode ends
           - malformed_weight * malformed tool calls (unparseable, unknown tool, bad arguments)
           - repeat_weight * repeated identical tool calls (the same name + arguments seen before: loops)
           - no_message_weight * [the episode ended without a final message to the user]
           - lint_weight * new lint findings (ruff) in the files the agent changed

  C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)),   and its q -> 1 limit log(1 + k x) / k.

C is concave for q > 0: the first tokens cost most, so the model is pushed to be quick on easy tasks while long work
on hard ones costs relatively little more. Every term is reported in the breakdown, signed as it enters the sum.

No term can be maximised instead of solving the task: every term but `task` is <= 0, so an unsolved episode scores
<= 0, and with `penalty_cap` < 1 the penalties together take at most `penalty_cap` (each scaled down in proportion,
so the breakdown still sums to the reward), so every solved episode scores >= 1 - penalty_cap > 0: success always
dominates, however many malformed calls or tokens an episode spends, while below the cap each term keeps its
weight. The todo and message terms are charged however the episode ends (finish, turn or segment limit): charging
them only at `finish` would let an agent dodge both by never finishing, since the hidden tests grade the workspace
either way.

Effort terms and giving up: length, todo and lint grow with the work an episode does (tokens spent, a plan left open,
edits that add lint findings), so an unsolved episode that finishes at once pays none of them while one that tried and
failed pays them all. With `effort_scope="all"` (every episode pays every term) giving up scores above a failed
attempt: in a group where every sample fails the advantage favours the samples that quit, and on a task the policy
solves less than about one time in six (at the recipe's weights: 0.9 p - 0.2 (1 - p) < -0.013) quitting has the higher
expected reward. Measured: from a start that solved 13% of held-out level-3 tasks at T=1, RL learned by step ~100 to
call finish on its first turn at every level-3 task. `effort_scope="solved"` charges the effort terms to solved
episodes only: between two successes the shorter, tidier one still scores higher (the report's "quick on easy tasks"),
while every unsolved episode that made no malformed or repeated call and ended with a message scores 0, trying or not,
so all-failed groups carry no signal at all. The tool-use terms (malformed, repeat, no_message) are charged to every
episode.
"""

from __future__ import annotations

import dataclasses
import math

LENGTH_UNITS = ("tokens", "turns", "tool_calls")
EFFORT_SCOPES = ("all", "solved")
EFFORT_TERMS = ("length", "todo", "lint")   # grow with the work done; `effort_scope` says who pays them


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
  penalty_cap: float = 0.0    # > 0: the penalties' sum is floored at -penalty_cap (0: no floor)
  effort_scope: str = "all"   # who pays EFFORT_TERMS: every episode ('all') or solved ones only ('solved')

  def __post_init__(self):
    if not 0.0 <= self.penalty_cap < 1.0:
      raise ValueError(f"penalty_cap must be in [0, 1) (0 = no cap; >= 1 would let penalties outweigh success), got "
                       f"{self.penalty_cap}")
    if self.length_unit not in LENGTH_UNITS:
      raise ValueError(f"length_unit {self.length_unit!r} not in {LENGTH_UNITS}")
    if self.length_k <= 0:
      raise ValueError(f"length_k must be > 0, got {self.length_k}")
    if self.effort_scope not in EFFORT_SCOPES:
      raise ValueError(f"effort_scope {self.effort_scope!r} not in {EFFORT_SCOPES}")


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
    reward (penalties scaled to `penalty_cap` in total when they exceed it); with `effort_scope="solved"` an unsolved
    episode's length, todo and lint terms are 0.
  """
  x = {"tokens": stats.output_tokens, "turns": stats.turns, "tool_calls": stats.tool_calls}[cfg.length_unit]
  no_message = not stats.final_message.strip()
  terms = {
    "task": float(task_reward),
    "length": -cfg.length_weight * length_penalty(x, cfg.length_k, cfg.length_q) if cfg.length_weight else 0.0,
    "todo": -cfg.todo_weight * stats.unfinished_todos,
    "malformed": -cfg.malformed_weight * stats.malformed_calls,
    "repeat": -cfg.repeat_weight * stats.repeated_calls,
    "no_message": -cfg.no_message_weight * float(no_message),
    "lint": -cfg.lint_weight * stats.new_lint_findings,
  }
  if cfg.effort_scope == "solved" and not task_reward:
    terms.update({k: 0.0 for k in EFFORT_TERMS})
  penalty = -sum(v for k, v in terms.items() if k != "task")
  if cfg.penalty_cap and penalty > cfg.penalty_cap:
    terms = {k: v if k == "task" else v * cfg.penalty_cap / penalty for k, v in terms.items()}
  return sum(terms.values()), terms

