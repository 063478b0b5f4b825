"""JSON Lines files: one JSON value a line, blank lines skipped, a line that is not JSON an error naming the file
and the line (every JSONL reader of the project reads through `records`)."""
from __future__ import annotations

import json
from collections.abc import Iterator


def records(path: str) -> Iterator[tuple[int, object]]:
  """(line number, value) of each non-blank line of `path`; raises ValueError("path:n: not valid JSON ...")."""
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        value = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
      yield n, value
