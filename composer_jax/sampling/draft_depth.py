"""Adaptive draft depth: each engine picks how many MTP drafts per step (k, 0 = plain decoding) from what it measured.

A speculative step with k drafts emits E(k) tokens per row and costs d(k) seconds; plain decoding is k = 0 with
E(0) = 1. The engine runs the k with the most tokens per second, E(k) / d(k), for the call's row bucket:

  E(k) = 1 + Σ_{j=1..k} Π_{i<j} a_i     a_i = P(draft i accepted | drafts 0..i-1 accepted), counted from the
                                         accepted run lengths of earlier speculative calls (`Output.stats`)
  seconds = p · prefill + d(k) · steps  fitted by least squares over the last few timed calls of every k in the
                                         bucket: `prefill` the tokens the call prefilled (window x unique prompts),
                                         `steps` its decode steps, p one prefill cost per token shared by all k

A call is prefill and decode in one program, so its seconds cannot be split by timing. Without the p term a call's
prefill would count as decode cost, the more so for a speculative call (fewer steps to spread it over), and calls of
different turns (prefix reuse leaves prefill windows of a few to hundreds of tokens) would be compared as if alike.
When the calls cannot separate the two terms (every call prefilled in proportion to its steps, or a fitted cost not
positive) d(k) falls back to each k's seconds per step, prefill included.

Drafts are chained from MTP module 0, so draft i does not depend on k: acceptances measured at the largest k give
every smaller k's E. The first call of each program (a new shape or k) compiles and is not timed. Until every k has a
cost for the bucket the engine tries the untimed ones in turn; after that it still runs the largest k every
`probe_every` calls so the acceptance (which moves with the policy) and its cost stay measured. Counts of older
policy versions are halved at every weight update. Which k runs never changes what is sampled: each k is exact
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
    """d(k) for `rows`, seconds per decode step (None: not timed yet)."""
    return self._fit(rows).get(k)

  def prefill_cost(self, rows: int) -> float:
    """p for `rows`, seconds per prefilled token (0 when the calls so far cannot separate it)."""
    return self._fit(rows).get("prefill", 0.0)

  def _fit(self, rows: int) -> dict:
    """{k: d(k), "prefill": p} from the timed calls of `rows` (see the module docstring)."""
    calls = [(k, *c) for k in range(self.max_k + 1) for c in self._costs.get((k, rows), ())]
    ks = sorted({k for k, *_ in calls})
    if not ks:
      return {}
    fallback = {k: float(np.mean([s / n for kk, s, n, _ in calls if kk == k])) for k in ks}
    x = np.array([[pf] + [n * (kk == k) for k in ks] for kk, _, n, pf in calls], np.float64)
    y = np.array([s for _, s, _, _ in calls], np.float64)
    sol, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    if rank < x.shape[1] or np.any(sol <= 0):
      return fallback
    return {"prefill": float(sol[0]), **{k: float(d) for k, d in zip(ks, sol[1:])}}

  def pick(self, rows: int) -> tuple[int, str]:
    """(k for the next call of `rows` rows, why): 'explore' (k not timed yet), 'probe' or 'best'."""
    self._calls += 1
    cost = self._fit(rows)   # one fit per call: the step costs of every k come from the same solve
    untimed = [k for k in range(self.max_k + 1) if k not in cost]
    if untimed:
      return (self.max_k if self.max_k in untimed else untimed[0]), "explore"
    best = max(range(self.max_k + 1), key=lambda k: self.tokens_per_step(k) / cost[k])
    self.chosen = best
    if best < self.max_k and self._calls % self.probe_every == 0:
      return self.max_k, "probe"
    return best, "best"

  def record(self, k: int, rows: int, accept_hist: np.ndarray | None, seconds: float | None, steps: int,
             prefill_tokens: int = 0) -> None:
    """One finished call: its accepted-run-length histogram (k ≥ 1: counts of n accepted drafts per row-step,
    length k + 1) and, unless it compiled, its wall time, decode steps and prefilled tokens."""
    if k and accept_hist is not None:
      h = np.asarray(accept_hist, np.float64)
      reached = h[::-1].cumsum()[::-1]           # row-steps with n >= j
      self.tried[:k] += reached[:k]
      self.passed[:k] += reached[1:k + 1]
    if seconds is not None and steps > 0:
      self._costs.setdefault((k, rows), collections.deque(maxlen=self._window)).append(
          (seconds, steps, prefill_tokens))

  def new_policy(self) -> None:
    """New weights: older acceptance counts weigh half (the drafter and the policy both moved)."""
    self.tried *= 0.5
    self.passed *= 0.5

  def describe(self, rows: int) -> str:
    """One line: the measured acceptance per draft, the prefill cost, and every k's step cost and tokens/s."""
    cost, parts = self._fit(rows), []
    for k in range(self.max_k + 1):
      c = cost.get(k)
      rate = f"{self.tokens_per_step(k) / c:.0f} tok/s/row" if c else "untimed"
      parts.append(f"k={k}: {self.tokens_per_step(k):.2f} tok/step, "
                   f"{c * 1e3:.2f} ms/step, {rate}" if c else f"k={k}: {rate}")
    acc = ", ".join(f"{a:.2f}" for a in self.acceptance())
    return (f"acceptance per draft [{acc}]; prefill {cost.get('prefill', 0.0) * 1e6:.1f} us/token; "
            + "; ".join(parts))
