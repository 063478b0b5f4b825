"""A group as a tree: episodes run to a branch point, fork (sandbox and context), and each branch samples on.

Branch points are turn boundaries: by default after the k-th action turn of an episode (its tool results
appended), every live episode at that depth forks into b. `TreeConfig(branch_turns=(0, 2), fanouts=(2, 4))` starts
2 independent episodes from the prompt and forks each into 4 after its second turn: 8 leaves, the group's G
samples; the flat group is `branch_turns=(0,), fanouts=(G,)`. A first branch turn k > 0 makes the first k turns a
trunk that all leaves share (the root's one child, whose advantage is 0: nothing to compare it with).

Branch points are turn starts, because there the sandbox is quiescent (tool calls are synchronous, nothing runs),
so its files are the whole state to fork, and the next request's prompt is exactly the shared context, so an engine
with prefix caching continues every branch from the shared KV prefix with no help from here (the branches'
requests extend one cached prefix; without a cache they are ordinary requests, so results are the same either
way). Which turn start:
  * by turn (the default): after the k-th action turn. A fixed schedule keeps G, the tree's shape and the compute
    per group the same across tasks.
  * where the policy is uncertain (`branch_entropy=h`): each `branch_turns[l] = k` is then a deadline, and an
    episode branches earlier, at the first action turn start after its previous branch point where the policy is
    uncertain what to do: a greedy probe of the next turn's first `probe_tokens` tokens (one batched engine call
    for the episodes at such a point; `GenerateResult.entropies`) meets a token whose entropy is >= h nats. The
    max over the probe, since a turn's first tokens are the tool-call syntax, nearly certain, and the choice of
    tool, file or constant comes a few tokens later. The probe is greedy so that the decision is a function of the
    state alone: deciding on the entropy of the turn the episode then keeps (or of any sampled probe that it
    keeps when it does not branch) would make the branches' continuations samples of π conditioned on that
    decision, and the credit's unbiasedness (`rollout.tree`) needs them to be π's own. A threshold decides at
    each turn start; "the highest-entropy turn start before k" would need every candidate held (snapshot and
    episode) until k and branches that restart from the past. The deadline still bounds G and the depth. The probe
    costs a short greedy decode per candidate turn start (prefix-cached); an engine that reports no entropies is
    an error in this mode.

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

import numpy as np

from rollout import harness
from rollout.engines.protocol import Engine
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task
from rollout.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Where a group branches and how wide.

  Attributes:
    branch_turns: the action turns after which episodes fork, increasing; 0 is the prompt. With `branch_entropy`,
      the latest turn each branch point may take.
    fanouts: branches at each of those points (>= 1 each; the product is the group's G).
    branch_entropy: None: branch exactly at `branch_turns`; h > 0: branch at the first earlier action turn start
      where a greedy probe of the next turn meets a token of entropy >= h nats (see the module docstring).
    probe_tokens: the probe's length (tokens of the next turn).
  """
  branch_turns: tuple[int, ...] = (0, 1)
  fanouts: tuple[int, ...] = (2, 2)
  branch_entropy: float | None = None
  probe_tokens: int = 32

  def __post_init__(self):
    turns, fans = tuple(self.branch_turns), tuple(self.fanouts)
    if not turns or len(turns) != len(fans) or any(b < 1 for b in fans) or turns[0] < 0 or \
       any(a >= b for a, b in zip(turns, turns[1:], strict=False)):
      raise ValueError(f"tree: need as many fanouts (each >= 1) as branch_turns (increasing, >= 0), got "
                       f"branch_turns={turns} fanouts={fans}")
    if self.size < 2:
      raise ValueError(f"tree: fanouts={fans} give {self.size} leaf; group advantages need >= 2")
    if self.branch_entropy is not None and not self.branch_entropy > 0:
      raise ValueError(f"tree: branch_entropy must be > 0 nats (or None: branch by turn), got {self.branch_entropy}")
    if self.probe_tokens < 1:
      raise ValueError(f"tree: probe_tokens must be >= 1, got {self.probe_tokens}")
    object.__setattr__(self, "branch_turns", turns)
    object.__setattr__(self, "fanouts", fans)

  @property
  def size(self) -> int:
    """G: the leaves of one group."""
    return math.prod(self.fanouts)


@dataclasses.dataclass
class _Place:
  """An episode's position in the tree: its path, where its nodes start, the next branch point it reaches, and the
  action turns it had at its latest branch point (an entropy branch point must come after it)."""
  path: list[int]
  starts: list[list[int]]
  level: int
  since: int = 0


def uncertain(engine: Engine, episodes: list, tree: TreeConfig) -> list[bool]:
  """Whether the policy is uncertain at each episode's next turn start: its greedy probe (`tree.probe_tokens` of
  the next turn, at the rollouts' temperature with top-k 1) meets a token of entropy >= `tree.branch_entropy`."""
  probes = []
  for ep in episodes:
    req = ep.request()
    params = dataclasses.replace(req.params, top_k=1, top_p=1.0,
                                 max_tokens=min(tree.probe_tokens, req.params.max_tokens))
    probes.append(dataclasses.replace(req, params=params, request_id=req.request_id + "/probe"))
  out = []
  for res in engine.generate(probes):
    if res.entropies is None:
      raise ValueError(f"tree branch_entropy={tree.branch_entropy}: the engine reports no entropies "
                       "(GenerateResult.entropies is None); branch by turn (branch_entropy=None) or use an engine "
                       "that reports them")
    out.append(bool(len(res.entropies)) and float(np.max(res.entropies)) >= tree.branch_entropy)
  return out


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
    ready, probe = [], []   # at their next branch point; at a turn start where an entropy branch may come first
    for ep in episodes:
      if not ep.active:   # ended: never branched, and may be being graded (its segments closed) in the background
        continue
      place = place_of(ep.index, (ep.segments[0] if ep.segments else ep.builder).prompt_len)
      if place.level >= len(tree.branch_turns):
        continue
      if ep.act_turns >= tree.branch_turns[place.level]:
        ready.append(ep)
      elif tree.branch_entropy is not None and ep.mode == "act" and ep.act_turns > place.since and \
          ep.request() is not None:
        probe.append(ep)
    if probe:
      ready += [ep for ep, yes in zip(probe, uncertain(engine, probe, tree), strict=True) if yes]
    new = []
    for ep in ready:
      place, start = places[ep.index], [len(ep.segments), len(ep.builder)]
      forks = []
      try:
        snap = envs.factory.snapshot(ep.ws)
        try:
          for j in range(tree.fanouts[place.level] - 1):
            forks.append(ep.fork(len(episodes) + len(new) + j, envs.factory.fork(snap)))
        finally:
          envs.factory.delete_snapshot(snap)
      except Exception as e:   # noqa: BLE001 - whatever the backend raised, the group cannot be completed
        for f in forks:
          f.ws.close()
        raise harness.SandboxStartError(f"task {task.id}: a branch of episode {ep.index} did not start: {e!r}") from e
      for j, child in enumerate([ep] + forks):
        places[child.index] = _Place(place.path + [j], place.starts + [start], place.level + 1, ep.act_turns)
      new += forks
    return new

  trajs = harness.run_episodes(engine, tokenizer, [task] * n0, envs, cfg, branch=branch)
  for i, traj in enumerate(trajs):
    place = place_of(i, traj.segments[0].prompt_len)
    traj.tree = {"path": place.path, "starts": place.starts,
                 "multiplicity": math.prod(tree.fanouts[place.level:])}
  return trajs
