"""Speculative decoding per policy version: what each engine measured, one JSON line per version it served, and
the reader that turns new lines into an RL step's metrics.

An engine's `VersionLog` counts, for the version it serves, greedy and sampled calls apart (their acceptances
differ): drafts proposed and accepted, row-steps (trunk forwards of one row) and the calls per draft depth k. When
the engine moves to new weights (or is closed) it appends the finished version's line to its own file
(`<dir>/<engine>.jsonl`, so several worker processes never share a file):

  {"engine": "w0-1234", "version": 7, "calls": 12, "k_calls": {"0": 9, "2": 3},
   "greedy": {"drafted": 0, "accepted": 0, "row_steps": 0}, "sampled": {"drafted": 480, "accepted": 301,
   "row_steps": 240}, "tokens": 2210, "timed_tokens": 2050, "decode_s": 3.1}

`VersionLogReader.metrics()` reads the lines appended since its last call (every engine's file), sums them per
version and returns the newest version's as `spec/*` metrics: acceptance (accepted / drafted), tokens per trunk
forward ((row_steps + accepted) / row_steps over speculative calls) for sampled and greedy calls, the mean k, and
tokens per second of the calls' programs (compiles left out). Older versions' lines read in the
same call (a slow worker's) stay in the files only.
"""
from __future__ import annotations

import collections
import json
import os
from collections.abc import Callable

MODES = ("greedy", "sampled")
COUNTS = ("drafted", "accepted", "row_steps")


def _empty(version: int, engine: str) -> dict:
  return {"engine": engine, "version": version, "calls": 0, "k_calls": {}, "tokens": 0, "timed_tokens": 0,
          "decode_s": 0.0,
          **{m: dict.fromkeys(COUNTS, 0) for m in MODES}}


class VersionLog:
  """One engine's counts for the policy version it serves (see the module docstring)."""

  def __init__(self, path: str = "", engine: str = "", log_fn: Callable[[str], None] | None = None):
    self.path, self.engine, self.log_fn = path, engine or f"pid{os.getpid()}", log_fn
    self.current: dict | None = None

  def add(self, version: int, greedy: bool, k: int, drafted: int, accepted: int, row_steps: int, tokens: int,
          seconds: float | None) -> None:
    """One call of `version`; `seconds` the run time of its programs without compiles (None: not timed)."""
    if self.current is not None and self.current["version"] != version:
      self.flush()
    if self.current is None:
      self.current = _empty(version, self.engine)
    c = self.current
    c["calls"] += 1
    c["k_calls"][str(k)] = c["k_calls"].get(str(k), 0) + 1
    c["tokens"] += tokens
    if seconds is not None:
      c["decode_s"] += seconds
      c["timed_tokens"] += tokens
    if k:
      mode = c["greedy" if greedy else "sampled"]
      mode["drafted"] += drafted
      mode["accepted"] += accepted
      mode["row_steps"] += row_steps

  def flush(self) -> dict | None:
    """Writes (and logs) the current version's line, if it served any call; returns it."""
    line, self.current = self.current, None
    if line is None:
      return None
    if self.path:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      with open(self.path, "a") as f:
        f.write(json.dumps(line) + "\n")
    if self.log_fn is not None:
      m = summary([line])
      self.log_fn(f"engine {self.engine} v{line['version']}: " + ", ".join(f"{k[5:]} {v:.3g}" for k, v in m.items()
                                                                           if k != "spec/version"))
    return line


def summary(lines: list[dict]) -> dict[str, float]:
  """`spec/*` metrics of lines of one version (summed over engines); rates without data are left out."""
  tot = {m: dict.fromkeys(COUNTS, 0) for m in MODES}
  calls, k_sum, secs, tokens = 0, 0, 0.0, 0
  for line in lines:
    for m in MODES:
      for c in COUNTS:
        tot[m][c] += line[m][c]
    calls += line["calls"]
    k_sum += sum(int(k) * n for k, n in line["k_calls"].items())
    secs += line["decode_s"]
    tokens += line["timed_tokens"]
  out = {"spec/version": float(lines[0]["version"]), "spec/draft_tokens_mean": k_sum / max(calls, 1)}
  for m in MODES:
    if tot[m]["drafted"]:
      out[f"spec/acceptance_{m}"] = tot[m]["accepted"] / tot[m]["drafted"]
      out[f"spec/tokens_per_forward_{m}"] = (tot[m]["row_steps"] + tot[m]["accepted"]) / tot[m]["row_steps"]
  if secs > 0:
    out["spec/decode_tokens_per_s"] = tokens / secs
  return out


class VersionLogReader:
  """Reads the engines' version lines in `directory` as they are appended (complete lines only)."""

  def __init__(self, directory: str):
    self.directory = directory
    self._offsets: dict[str, int] = {}

  def new_lines(self) -> list[dict]:
    out = []
    if not os.path.isdir(self.directory):
      return out
    for name in sorted(os.listdir(self.directory)):
      if not name.endswith(".jsonl"):
        continue
      path = os.path.join(self.directory, name)
      with open(path, "rb") as f:
        f.seek(self._offsets.get(path, 0))
        data = f.read()
      end = data.rfind(b"\n") + 1    # a line still being written waits for the next call
      self._offsets[path] = self._offsets.get(path, 0) + end
      out += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return out

  def metrics(self) -> dict[str, float]:
    """The newest version among the lines appended since the last call, as `spec/*` metrics ({} if none)."""
    by_version = collections.defaultdict(list)
    for line in self.new_lines():
      by_version[line["version"]].append(line)
    return summary(by_version[max(by_version)]) if by_version else {}
