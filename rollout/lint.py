"""Code-quality signal: new ruff findings in the files an agent changed, measured inside its workspace."""

from __future__ import annotations

import json
import os
import shlex
from collections import Counter

from rollout.workspace import Workspace

BASE_DIR = ".lint_base"
RUFF = "python3 -m ruff check --no-cache --isolated --exit-zero --output-format=json --select E,F,W,B"


def new_findings(ws: Workspace, originals: dict[str, str | None], timeout_s: float = 30.0) -> int:
  """Sum over changed Python files of max(0, findings after - findings before); a new file counts from 0.

  Args:
    ws: the agent's workspace after the episode.
    originals: path -> text before the agent's first change (None for files it created).
    timeout_s: limit for the ruff run.

  Returns:
    The number of new findings. Files the agent deleted count 0.
  """
  paths = [p for p in sorted(originals) if p.endswith(".py") and ws.exists(p)]
  if not paths:
    return 0
  for p in paths:
    if originals[p] is not None:
      ws.write_file(os.path.join(BASE_DIR, p), originals[p])
  before = [os.path.join(BASE_DIR, p) for p in paths if originals[p] is not None]
  files = " ".join(shlex.quote(p) for p in paths + before)
  res = ws.run(f"{RUFF} {files}; rm -rf {BASE_DIR}", timeout_s=timeout_s, output_limit=1 << 22)
  if not res.ok:
    raise RuntimeError(f"ruff failed in the workspace (exit {res.exit_code}): {res.output[-300:]}")
  out = res.output
  findings = json.loads(out[out.index("["):]) if "[" in out else []
  counts = Counter(os.path.relpath(f["filename"], _root(f["filename"], paths)) for f in findings)
  return sum(max(0, counts[p] - counts[os.path.join(BASE_DIR, p)]) for p in paths)


def _root(filename: str, paths: list[str]) -> str:
  """The workspace root inside an absolute ruff filename (ruff reports absolute paths)."""
  for p in paths:
    for rel in (os.path.join(BASE_DIR, p), p):
      if filename.endswith("/" + rel):
        return filename[:-len(rel) - 1]
  return os.path.dirname(filename)
