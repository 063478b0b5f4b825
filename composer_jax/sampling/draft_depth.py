"""Adaptive draft depth: each engine picks how many MTP drafts per step (k, 0 = plain decoding) from what it measured.

A speculative step with k drafts emits E(k) tokens per row and costs c(k) seconds; plain decoding is k = 0 with
E(0) = 1. The engine runs the k with the most tokens per second, E(k) / c(k), for the call's row bucket:

  E(k) = 1 + Σ_{j=1..k} Π_{i<j} a_i     a_i = P(draft i accepted | drafts 0..i-1 accepted), counted from the
                                         accepted run lengths of earlier speculative calls (`Output.stats`)
  c(k) = seconds per decode step          a call's wall time over its decode steps, mean of the last few timed calls

Drafts are chained from MTP module 0, so draft i does not depend on k: acceptances measured at the largest k give
every smaller k's E. The first call of each program (a new shape or k) compiles and is not timed. Until every k has a
cost for the bucket the engine tries the untimed ones in turn; after that it still runs the largest k every
`probe_every` calls so the acceptance (which moves with the policy) and its cost stay measured. Counts of older
policy versions are halved at every weight update.

c(k) includes the call's prefill spread over its steps; speculative calls take fewer steps, so this slightly
overstates their cost (the choice leans to smaller k). Which k runs never changes what is sampled: each k is exact
rejection sampling (`speculative.py`), only its random stream differs.
"""
from __future__ import annotations

import collections

import numpy as np


class DraftDepth:
  """The per-engine chooser of k in 0..max_k (see the module docstring)."""

  def __init__(self, max_k: int, probe_every: int = 8, window: int = 4):
    if max_k < 1 or probe_every < 1:
      raise ValueError(f"need max_k >= 1 and probe_every >= 1, got {max_k=} {probe_every=}")
    self.max_k, self.probe_every = max_k, probe_every
    self.tried = np.zeros(max_k, np.float64)      # row-steps that reached draft i
    self.passed = np.zeros(max_k, np.float64)     # ... and accepted it
    self._costs: dict[tuple[int, int], collections.deque] = {}
    self._window = window
    self._calls = 0
    self.chosen: int | None = None                # the k of the last non-probing choice

  def acceptance(self) -> np.ndarray:
    """a_i for i < max_k: the measured conditional acceptance of draft i (0 where never tried)."""
    return np.where(self.tried > 0, self.passed / np.maximum(self.tried, 1), 0.0)

  def tokens_per_step(self, k: int) -> float:
    """E(k): expected tokens a row emits per step with k drafts."""
    return float(1 + np.cumprod(self.acceptance()[:k]).sum())

  def step_cost(self, k: int, rows: int) -> float | None:
    """c(k) for `rows`, seconds per decode step (None: not timed yet)."""
    got = self._costs.get((k, rows))
    return float(np.mean(got)) if got else None

  def pick(self, rows: int) -> tuple[int, str]:
    """(k for the next call of `rows` rows, why): 'explore' (k not timed yet), 'probe' or 'best'."""
    self._calls += 1
    untimed = [k for k in range(self.max_k + 1) if self.step_cost(k, rows) is None]
    if untimed:
      return (self.max_k if self.max_k in untimed else untimed[0]), "explore"
    best = max(range(self.max_k + 1), key=lambda k: self.tokens_per_step(k) / self.step_cost(k, rows))
    self.chosen = best
    if best < self.max_k and self._calls % self.probe_every == 0:
      return self.max_k, "probe"
    return best, "best"

  def record(self, k: int, rows: int, accept_hist: np.ndarray | None, seconds: float | None, steps: int) -> None:
    """One finished call: its accepted-run-length histogram (k ≥ 1: counts of n accepted drafts per row-step,
    length k + 1) and, unless it compiled, its wall time over `steps` decode steps."""
    if k and accept_hist is not None:
      h = np.asarray(accept_hist, np.float64)
      reached = h[::-1].cumsum()[::-1]           # row-steps with n >= j
      self.tried[:k] += reached[:k]
      self.passed[:k] += reached[1:k + 1]
    if seconds is not None and steps > 0:
      self._costs.setdefault((k, rows), collections.deque(maxlen=self._window)).append(seconds / steps)

  def new_policy(self) -> None:
    """New weights: older acceptance counts weigh half (the drafter and the policy both moved)."""
    self.tried *= 0.5
    self.passed *= 0.5

  def describe(self, rows: int) -> str:
    """One line: the measured acceptance per draft, the cost and expected tokens/s of every k."""
    parts = []
    for k in range(self.max_k + 1):
      c = self.step_cost(k, rows)
      rate = f"{self.tokens_per_step(k) / c:.0f} tok/s/row" if c else "untimed"
      parts.append(f"k={k}: {self.tokens_per_step(k):.2f} tok/step, "
                   f"{c * 1e3:.2f} ms/step, {rate}" if c else f"k={k}: {rate}")
    acc = ", ".join(f"{a:.2f}" for a in self.acceptance())
    return f"acceptance per draft [{acc}]; " + "; ".join(parts)
