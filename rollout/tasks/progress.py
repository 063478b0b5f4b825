"""A progress bar for long task-pipeline steps (mining, gold validation): counts of kept / rejected items and the
most common rejection reasons, updated as each item finishes."""

from __future__ import annotations

import collections
import re
import sys

from tqdm import tqdm


def reason_kind(reason: str) -> str:
  """A reason without its specifics (paths, ids, numbers, quoted output), so equal kinds are counted together."""
  head = re.split(r"[:(]", reason)[0].strip()
  return re.sub(r"\d+(\.\d+)?", "N", head)[:60]


class Progress:
  """`with Progress("mine repo", total) as p: p.kept() / p.rejected(reason)`; writes to stderr (not the log)."""

  def __init__(self, desc: str, total: int, enabled: bool = True):
    self.reasons: collections.Counter[str] = collections.Counter()
    self.n_kept = 0
    self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr, disable=not enabled,
                     mininterval=0.5)

  def kept(self) -> None:
    self.n_kept += 1
    self._step()

  def rejected(self, reason: str) -> None:
    self.reasons[reason_kind(reason)] += 1
    self._step()

  def _step(self) -> None:
    top = "; ".join(f"{k} x{v}" for k, v in self.reasons.most_common(3))
    self._bar.set_postfix_str(f"kept {self.n_kept}, rejected {sum(self.reasons.values())}" + (f" ({top})" if top
                                                                                               else ""), refresh=False)
    self._bar.update(1)

  def summary(self) -> str:
    """'kept K, rejected R: reason xN, ...' (every reason kind)."""
    reasons = ", ".join(f"{k} x{v}" for k, v in self.reasons.most_common())
    return f"kept {self.n_kept}, rejected {sum(self.reasons.values())}" + (f": {reasons}" if reasons else "")

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self._bar.close()
