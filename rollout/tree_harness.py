"""A group as a tree: episodes run to a branch point, fork (sandbox and context), and each branch samples on.

Branch points are turn boundaries: after the k-th action turn of an episode (its tool results appended), every
live episode at that depth forks into b. `TreeConfig(branch_turns=(0, 2), fanouts=(2, 4))` starts 2 independent
episodes from the prompt and forks each into 4 after its second turn: 8 leaves, the group's G samples; the flat
group is `branch_turns=(0,), fanouts=(G,)`. A first branch turn k > 0 makes the first k turns a trunk that all
leaves share (the root's one child, whose advantage is 0: nothing to compare it with).

Why after a turn, and not where the policy is uncertain (high entropy at a turn's start): at a turn boundary the
sandbox is quiescent (tool calls are synchronous, nothing runs), so its files are the whole state to fork; the next
request's prompt is exactly the shared context, so an engine with prefix caching continues every branch from the
shared KV prefix with no help from here (the branches' requests extend one cached prefix; without a cache they are
ordinary requests, so results are the same either way); and a fixed schedule keeps G and the compute per group
equal across tasks, which a data-dependent rule would not (and `Engine` reports no entropy).

Forking an episode (`harness._Episode.fork`) snapshots its workspace (an overlay layer in the `sandboxes`
backend, not a replay of the commands) and forks b − 1 copies from it; the original continues as branch 0. Its
context, transcript and tool state are copied, and each branch gets its own request seeds. A fork that fails is a
`harness.SandboxStartError`, so the worker retries or drops the group whole, as for any sandbox that does not
start. An episode that ends before a branch point (it finished, or ran out of turns) is a leaf standing for all
the branches it would have had (`multiplicity`, `rollout.tree`), so every group has exactly G leaves. Each leaf's
`Trajectory.tree` records its path and where its nodes start; `rollout.tree` turns that into credit.
"""
from __future__ import annotations

import dataclasses
import math

from rollout import harness
from rollout.engines.protocol import Engine
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task
from rollout.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Where a group branches and how wide.

  Attributes:
    branch_turns: the action turns after which episodes fork, increasing; 0 is the prompt.
    fanouts: branches at each of those points (>= 1 each; the product is the group's G).
  """
  branch_turns: tuple[int, ...] = (0, 1)
  fanouts: tuple[int, ...] = (2, 2)

  def __post_init__(self):
    turns, fans = tuple(self.branch_turns), tuple(self.fanouts)
    if not turns or len(turns) != len(fans) or any(b < 1 for b in fans) or turns[0] < 0 or \
       any(a >= b for a, b in zip(turns, turns[1:], strict=False)):
      raise ValueError(f"tree: need as many fanouts (each >= 1) as branch_turns (increasing, >= 0), got "
                       f"branch_turns={turns} fanouts={fans}")
    if self.size < 2:
      raise ValueError(f"tree: fanouts={fans} give {self.size} leaf; group advantages need >= 2")
    object.__setattr__(self, "branch_turns", turns)
    object.__setattr__(self, "fanouts", fans)

  @property
  def size(self) -> int:
    """G: the leaves of one group."""
    return math.prod(self.fanouts)


@dataclasses.dataclass
class _Place:
  """An episode's position in the tree: its path, where its nodes start, and the next branch point it reaches."""
  path: list[int]
  starts: list[list[int]]
  level: int


def rollout_tree(engine: Engine, tokenizer, task: Task, envs: EnvironmentCache, cfg: harness.HarnessConfig,
                 tree: TreeConfig) -> list[Trajectory]:
  """One group of `tree.size` leaves of `task`, sampled as a tree; each trajectory carries its `tree` spec."""
  at_prompt = tree.branch_turns[0] == 0
  n0 = tree.fanouts[0] if at_prompt else 1
  places: dict[int, _Place] = {}        # by episode index; index = the order run_episodes returns trajectories in

  def place_of(index: int, prompt_len: int) -> _Place:
    """An episode's place; one of the first episodes gets its root node when first seen."""
    if index not in places:
      places[index] = _Place([index] if at_prompt else [0], [[0, prompt_len]], int(at_prompt))
    return places[index]

  def branch(episodes: list) -> list:
    new = []
    for ep in list(episodes):
      place = place_of(ep.index, (ep.segments[0] if ep.segments else ep.builder).prompt_len)
      if not ep.active or place.level >= len(tree.branch_turns) or ep.act_turns < tree.branch_turns[place.level]:
        continue
      start = [len(ep.segments), len(ep.builder)]
      b = tree.fanouts[place.level]
      forks = []
      try:
        snap = envs.factory.snapshot(ep.ws)
        try:
          for j in range(b - 1):
            forks.append(ep.fork(len(episodes) + len(new) + j, envs.factory.fork(snap)))
        finally:
          envs.factory.delete_snapshot(snap)
      except Exception as e:   # noqa: BLE001 - whatever the backend raised, the group cannot be completed
        for f in forks:
          f.ws.close()
        raise harness.SandboxStartError(f"task {task.id}: a branch of episode {ep.index} did not start: {e!r}") from e
      for j, child in enumerate([ep] + forks):
        places[child.index] = _Place(place.path + [j], place.starts + [start], place.level + 1)
      new += forks
    return new

  trajs = harness.run_episodes(engine, tokenizer, [task] * n0, envs, cfg, branch=branch)
  for i, traj in enumerate(trajs):
    place = place_of(i, traj.segments[0].prompt_len)
    traj.tree = {"path": place.path, "starts": place.starts,
                 "multiplicity": math.prod(tree.fanouts[place.level:])}
  return trajs
