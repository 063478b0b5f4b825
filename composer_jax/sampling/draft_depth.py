"""Adaptive draft depth: each engine picks how many MTP drafts per step (k, 0 = plain decoding) from what it measured.

A speculative step with k drafts emits E(k) tokens per row and costs d(k) seconds; plain decoding is k = 0 with
E(0) = 1. The engine runs the k with the most tokens per second, E(k) / d(k):

  E(k) = 1 + Σ_{j=1..k} Π_{i<j} a_i     a_i = P(draft i accepted | drafts 0..i-1 accepted), counted from the
                                         accepted run lengths of every speculative decode (`Output.stats`)
  d(k, shape)                           the median seconds per step of the last few decode programs of k on that
                                         decode shape (rows, prompt width, output length, ...), timed alone

The engine runs a call as two programs, prefill then decode (`engine.py`), and times the decode program alone with
its compile excluded, so d(k) is measured, not fitted: a call's prefill (a few to hundreds of tokens per turn with
prefix reuse) never counts as decode cost. Step costs depend on the shape (attention spans the prompt and output
slots, rows share a step), so two depths are compared only on the shapes where both were timed (geometric mean of
their cost ratios there).

Every (k, shape) is its own compiled program, and compiles, not steps, dominated a short multi-turn run when every k
was explored on every new shape. So the choice is one per engine, made once and then kept unless beaten:
  * explore: the engine's first call runs its prefill once and then the decode of every k on it, each program
    compiled once on that shape: K..0 untimed (a program's first run after its compile touches fresh memory), then
    0..K and K..0 timed (so load drifts cancel); the call returns k = K's output (fixed before anything ran, so the
    choice of output never depends on what was sampled);
  * then every call runs the chosen k, compiling only what an engine fixed at that k compiles;
  * probe: every `probe_every`-th call whose shape has another k compiled runs that k instead (the others in turn),
    so the acceptance of deeper drafts (it moves with the policy) and the other costs stay measured without a
    compile;
  * the choice changes only when another k's E / d beats the chosen one's by more than `margin` (hysteresis: a switch
    compiles the new k's programs as it meets shapes).
Counts of older policy versions are halved at every weight update. Drafts are chained from MTP module 0, so draft i
does not depend on k: acceptances measured at a larger k give every smaller k's E. Which k runs never changes what
is sampled: each k is exact rejection sampling (`speculative.py`), only its random stream differs.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Hashable

import numpy as np


class DraftDepth:
  """The per-engine chooser of k in 0..max_k (see the module docstring)."""

  def __init__(self, max_k: int, probe_every: int = 8, window: int = 8, margin: float = 0.05):
    if max_k < 1 or probe_every < 1:
      raise ValueError(f"need max_k >= 1 and probe_every >= 1, got {max_k=} {probe_every=}")
    self.max_k, self.probe_every, self.margin = max_k, probe_every, margin
    self.tried = np.zeros(max_k, np.float64)      # row-steps that reached draft i
    self.passed = np.zeros(max_k, np.float64)     # ... and accepted it
    self._costs: dict[tuple[int, Hashable], collections.deque] = {}
    self._window = window
    self._probe_due = 0                           # calls that could probe since the last probe
    self._probes = 0
    self._untimed: set[int] = set()               # depths whose next run is their first after compiling
    self.chosen: int | None = None                # None until the first call's exploration is recorded
    self.explored_shape: Hashable | None = None

  def acceptance(self) -> np.ndarray:
    """a_i for i < max_k: the measured conditional acceptance of draft i (0 where never tried)."""
    return np.where(self.tried > 0, self.passed / np.maximum(self.tried, 1), 0.0)

  def tokens_per_step(self, k: int) -> float:
    """E(k): expected tokens a row emits per step with k drafts."""
    return float(1 + np.cumprod(self.acceptance()[:k]).sum())

  def step_cost(self, k: int, shape: Hashable) -> float | None:
    """d(k) on `shape`, seconds per decode step (None: not timed there)."""
    runs = self._costs.get((k, shape))
    return float(np.median(runs)) if runs else None

  def relative_rate(self, k: int, ref: int) -> float | None:
    """(E(k) / d(k)) / (E(ref) / d(ref)) over the shapes where both were timed (None: none)."""
    shapes = [s for kk, s in self._costs if kk == k and (ref, s) in self._costs]
    if not shapes:
      return None
    log_ratio = np.mean([np.log(self.step_cost(ref, s) / self.step_cost(k, s)) for s in shapes])
    return self.tokens_per_step(k) / self.tokens_per_step(ref) * float(np.exp(log_ratio))

  def pick(self, shape: Hashable, compiled: Callable[[int], bool]) -> tuple[list[int], str]:
    """(the depths to decode this call's prefill with, the first one's output returned; why): 'explore' (every k,
    the engine's first call), 'probe' (another k already compiled for `shape`) or 'best'."""
    if self.chosen is None:
      down = list(range(self.max_k, -1, -1))
      self.explored_shape, self._untimed = shape, set(down)
      return down + down[::-1] + down, "explore"
    others = [k for k in range(self.max_k + 1) if k != self.chosen and compiled(k)]
    if others:
      self._probe_due += 1
      if self._probe_due >= self.probe_every:
        self._probe_due = 0
        self._probes += 1
        return [others[self._probes % len(others)]], "probe"
    return [self.chosen], "best"

  def record(self, k: int, shape: Hashable, accept_hist: np.ndarray | None, seconds: float | None,
             steps: int) -> None:
    """One decode run: its accepted-run-length histogram (k ≥ 1: counts of n accepted drafts per row-step, length
    k + 1) and its seconds (the decode program alone, compile excluded; None: not timed) over its steps."""
    if k and accept_hist is not None:
      h = np.asarray(accept_hist, np.float64)
      reached = h[::-1].cumsum()[::-1]           # row-steps with n >= j
      self.tried[:k] += reached[:k]
      self.passed[:k] += reached[1:k + 1]
    if k in self._untimed:
      self._untimed.discard(k)
    elif seconds is not None and steps > 0:
      self._costs.setdefault((k, shape), collections.deque(maxlen=self._window)).append(seconds / steps)

  def settle(self) -> bool:
    """Chooses after the recorded runs: the first time the best timed k against k = max_k, later a switch only when
    another k beats the chosen one by more than `margin`. True when the choice changed."""
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

  def describe(self, shape: Hashable) -> str:
    """One line: the measured acceptance per draft and every k's step cost on `shape` and tokens/s per row."""
    parts = []
    for k in range(self.max_k + 1):
      c = self.step_cost(k, shape)
      parts.append(f"k={k}: {self.tokens_per_step(k):.2f} tok/step, {c * 1e3:.2f} ms/step, "
                   f"{self.tokens_per_step(k) / c:.0f} tok/s/row" if c else f"k={k}: untimed")
    acc = ", ".join(f"{a:.2f}" for a in self.acceptance())
    return f"acceptance per draft [{acc}]; " + "; ".join(parts)
