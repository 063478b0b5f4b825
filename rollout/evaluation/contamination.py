"""Contamination guard: which tasks' gold solutions (post-change files) appear in a pretraining corpus.

A task's solution is the text of the files its gold patch changed, after the patch (from gold validation). Lines are
normalised (whitespace collapsed, blank lines dropped); every window of `window` consecutive lines that contains a
line the patch added is a probe (a file shorter than the window is one probe). A task is flagged when the fraction
of its probes found verbatim in the corpus's own line windows reaches `threshold`. Hashing line windows keeps the
index small (one 64-bit hash per corpus line) and finds a solution copied anywhere inside a longer document.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping

from rollout.tasks.task import Task


def _norm_lines(text: str) -> list[str]:
  return [" ".join(ln.split()) for ln in text.splitlines() if ln.strip()]


def _h(lines: list[str]) -> int:
  return int.from_bytes(hashlib.blake2b("\n".join(lines).encode(), digest_size=8).digest(), "little")


@dataclasses.dataclass(frozen=True)
class ContaminationConfig:
  """window: lines per probe; threshold: flagged when this fraction of a task's probes is in the corpus."""
  window: int = 4
  threshold: float = 0.5

  def __post_init__(self):
    if self.window < 1 or not 0 < self.threshold <= 1:
      raise ValueError(f"need window >= 1 and 0 < threshold <= 1, got {self.window=} {self.threshold=}")


class CorpusIndex:
  """Hashes of every window of 1..`window` consecutive normalised lines of each corpus document."""

  def __init__(self, documents: Iterable[str], cfg: ContaminationConfig = ContaminationConfig()):
    self.cfg = cfg
    self.hashes: set[int] = set()
    self.n_documents = 0
    for doc in documents:
      self.n_documents += 1
      lines = _norm_lines(doc)
      # Short windows too, so a solution file shorter than `window` lines can match inside a longer document.
      for w in range(1, cfg.window + 1):
        for i in range(len(lines) - w + 1):
          self.hashes.add(_h(lines[i:i + w]))

  def probes_found(self, text: str, added: set[str]) -> tuple[int, int]:
    """(probes found, probes) for one post-change file; `added` are the normalised lines the patch added."""
    lines = _norm_lines(text)
    w = min(self.cfg.window, len(lines))
    if w == 0:
      return 0, 0
    probes = [lines[i:i + w] for i in range(len(lines) - w + 1) if added & set(lines[i:i + w])]
    return sum(_h(p) in self.hashes for p in probes), len(probes)


SKIP_DIRS = (".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".pytest_cache", ".tox", "node_modules")


def read_corpus(path: str) -> Iterable[str]:
  """Documents of a corpus: every text file under a directory (not inside version-control or cache directories,
  `SKIP_DIRS`; binary files skipped), or the `text` field of each line of a JSONL file (what
  `composer_jax.train.corpus.export_corpus` writes)."""
  if os.path.isdir(path):
    for root, dirs, files in os.walk(path):
      dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
      for name in sorted(files):
        with open(os.path.join(root, name), "rb") as f:
          data = f.read()
        if b"\0" not in data:
          yield data.decode("utf-8", errors="replace")
  elif path.endswith((".jsonl", ".json")):
    with open(path, encoding="utf-8") as f:
      for i, line in enumerate(f, 1):
        if line.strip():
          try:
            yield json.loads(line)["text"]
          except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{i}: expected a JSON object with a 'text' field") from None
  elif os.path.isfile(path):
    with open(path, encoding="utf-8", errors="replace") as f:
      yield f.read()
  else:
    raise FileNotFoundError(f"corpus {path!r} does not exist")


def added_lines(patch: str) -> set[str]:
  """Normalised non-blank lines a unified diff adds."""
  return {" ".join(ln[1:].split()) for ln in patch.splitlines()
          if ln.startswith("+") and not ln.startswith("+++") and ln[1:].strip()}


def check(tasks: Iterable[Task], post_files: Mapping[str, Mapping[str, str]],
          index: CorpusIndex) -> dict[str, float]:
  """Task id -> fraction of its solution probes found in the corpus, for tasks at or above the threshold.

  Args:
    tasks: the tasks (their gold patches say which lines were added).
    post_files: task id -> {path: post-change text} (`gold.GoldCheck.post_files`).
    index: the corpus index.
  """
  flagged = {}
  for t in tasks:
    added = added_lines(t.gold_patch)
    found = total = 0
    for text in post_files.get(t.id, {}).values():
      f, n = index.probes_found(text, added)
      found, total = found + f, total + n
    if total and found / total >= index.cfg.threshold:
      flagged[t.id] = found / total
  return flagged
