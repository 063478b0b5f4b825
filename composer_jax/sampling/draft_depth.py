"""Adaptive draft depth: each engine picks how many MTP drafts per step (k, 0 = plain decoding) from what it measured.

The engine runs the k whose decode programs emit the most tokens per second on its own calls. It runs a call as
two programs, prefill then decode (`engine.py`), and times the decode program alone with its compile excluded, so a
call's prefill (a few to hundreds of tokens per turn with prefix reuse) never counts as decode cost. Depths are
compared on the same calls: a call that decodes its one prefill with several k gives each k's tokens and seconds on
identical inputs, and each k's rate is pooled over the recent calls that timed it beside the other.

Why measured rates on paired calls rather than E(k) / d(k) from per-step costs: a step's cost depends on the call
(how many rows are still active, how long each runs, a program's fixed cost per call), so per-step costs measured
on one kind of call mis-rank k on the others; on the default recipe's episodes k = 1 and plain decoding tied on
the first turn's calls (16 long rows) while k = 1 was 1.3-1.5x faster over the whole episodes.

Every (k, shape) is its own compiled program, and compiles dominated a short multi-turn run when every k was
explored and probed on every new shape. So the choice is one per engine, made once and kept unless beaten:
  * explore: the engine's first `explore_calls` calls decode with every k (the one whose output is returned turns
    in order, fixed before anything ran, so the returned output never depends on what was sampled), compiling
    each k on the shapes those calls meet; a run just compiled is not timed (its first run touches fresh memory);
  * then every call runs the chosen k, compiling only what an engine fixed at that k compiles;
  * probe: every `probe_every`-th call whose shape has another k compiled also decodes with that k (the others in
    turn; the chosen k's output is returned), so the rates stay measured as the policy moves, without a compile;
  * the choice changes only when another k's rate beats the chosen one's by more than `margin` (hysteresis: a
    switch compiles the new k's programs as it meets shapes).
E(k) = 1 + Σ_{j=1..k} Π_{i<j} a_i, from the measured conditional acceptance a_i of draft i (counted from the accepted
run lengths of every speculative decode; drafts are chained from MTP module 0, so draft i does not depend on k), is
what the engine logs beside the rates; counts of older policy versions are halved at every weight update. Which k
runs never changes what is sampled: each k is exact rejection sampling (`speculative.py`), only its random stream
differs.
"""
from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np


class DraftDepth:
  """The per-engine chooser of k in 0..max_k (see the module docstring)."""

  def __init__(self, max_k: int, probe_every: int = 32, explore_calls: int = 8, window: int = 16,
               margin: float = 0.1):
    if max_k < 1 or probe_every < 1 or explore_calls < 1:
      raise ValueError(f"need max_k, probe_every and explore_calls >= 1, got {max_k=} {probe_every=} "
                       f"{explore_calls=}")
    self.max_k, self.probe_every, self.explore_calls, self.margin = max_k, probe_every, explore_calls, margin
    self.tried = np.zeros(max_k, np.float64)      # row-steps that reached draft i
    self.passed = np.zeros(max_k, np.float64)     # ... and accepted it
    self._pairs: collections.deque = collections.deque(maxlen=window)   # {k: (tokens, seconds)} per paired call
    self._calls = 0
    self._probe_due = 0                           # calls that could probe since the last probe
    self.probes = 0                               # probing calls so far
    self.chosen: int | None = None                # None while exploring

  def acceptance(self) -> np.ndarray:
    """a_i for i < max_k: the measured conditional acceptance of draft i (0 where never tried)."""
    return np.where(self.tried > 0, self.passed / np.maximum(self.tried, 1), 0.0)

  def tokens_per_step(self, k: int) -> float:
    """E(k): expected tokens a row emits per step with k drafts."""
    return float(1 + np.cumprod(self.acceptance()[:k]).sum())

  def rate(self, k: int, ref: int) -> tuple[float, float] | None:
    """(k's, ref's) decode tokens per second, each pooled over the recent calls that timed both (None: none)."""
    calls = [c for c in self._pairs if k in c and ref in c]
    if not calls:
      return None
    pooled = lambda j: sum(c[j][0] for c in calls) / sum(c[j][1] for c in calls)  # noqa: E731
    return pooled(k), pooled(ref)

  def relative_rate(self, k: int, ref: int) -> float | None:
    """k's decode tokens per second over ref's, on the recent calls that decoded with both (None: none)."""
    r = self.rate(k, ref)
    return None if r is None else r[0] / r[1]

  def pick(self, compiled: Callable[[int], bool]) -> tuple[list[int], str]:
    """(the depths to decode this call's prefill with, the first one's output returned; why): 'explore' (every k,
    the first returned in turn), 'probe' (the chosen k and another already compiled for this call's shape) or
    'best'. `compiled(k)`: whether k's decode program exists for this call's shape."""
    self._calls += 1
    every = list(range(self.max_k + 1))
    if self.chosen is None:
      r = self._calls % len(every)
      return every[r:] + every[:r], "explore"
    others = [k for k in every if k != self.chosen and compiled(k)]
    if others:
      self._probe_due += 1
      if self._probe_due >= self.probe_every:
        self._probe_due = 0
        self.probes += 1
        return [self.chosen, others[self.probes % len(others)]], "probe"
    return [self.chosen], "best"

  def record(self, runs: list[tuple[int, np.ndarray | None, int, float | None]]) -> None:
    """One call's decode runs on one prefill, each (k, accepted-run-length histogram (k ≥ 1: counts of n accepted
    drafts per row-step, length k + 1), tokens emitted, seconds of the decode program alone without compiles (None:
    not timed, e.g. its first run after compiling))."""
    for k, accept_hist, _, _ in runs:
      if k and accept_hist is not None:
        h = np.asarray(accept_hist, np.float64)
        reached = h[::-1].cumsum()[::-1]           # row-steps with n >= j
        self.tried[:k] += reached[:k]
        self.passed[:k] += reached[1:k + 1]
    timed = {k: (tokens, seconds) for k, _, tokens, seconds in runs if seconds and tokens > 0}
    if len(timed) > 1:
      self._pairs.append(timed)

  def settle(self) -> bool:
    """Chooses after a call: once `explore_calls` calls have explored, the k with the most tokens per second
    against k = max_k (max_k when no call timed two depths); later a switch only when another k beats the chosen
    one by more than `margin`. True when the choice changed."""
    if self.chosen is None and self._calls < self.explore_calls:
      return False
    ref = self.max_k if self.chosen is None else self.chosen
    rates = {k: self.relative_rate(k, ref) for k in range(self.max_k + 1) if k != ref}
    rates = {k: r for k, r in rates.items() if r is not None}
    best = max(rates, key=rates.get, default=ref)
    if self.chosen is None:
      self.chosen = best if rates.get(best, 0.0) > 1.0 else ref
      return True
    if rates.get(best, 0.0) > 1.0 + self.margin:
      self.chosen = best
      return True
    return False

  def new_policy(self) -> None:
    """New weights: older acceptance counts weigh half (the drafter and the policy both moved)."""
    self.tried *= 0.5
    self.passed *= 0.5

  def describe(self) -> str:
    """One line: the measured acceptance per draft, E(k), and every k's tokens/s against the chosen one's."""
    ref, parts = self.chosen if self.chosen is not None else self.max_k, []
    for k in range(self.max_k + 1):
      r = self.rate(k, ref) if k != ref else None
      vs = f"{r[0]:.0f} tok/s vs {r[1]:.0f} for k={ref}" if r else ("chosen" if k == ref else "untimed")
      parts.append(f"k={k}: {self.tokens_per_step(k):.2f} tok/step, {vs}")
    acc = ", ".join(f"{a:.2f}" for a in self.acceptance())
    return f"acceptance per draft [{acc}]; " + "; ".join(parts)
