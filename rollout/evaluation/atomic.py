"""Writing a file whole or not at all: a reader (or a run killed mid-write) sees the old file, the new one, or none."""
from __future__ import annotations

import os
import tempfile


def write_text(path: str, text: str) -> None:
  """Writes `text` to a temporary file beside `path`, then renames it over `path` (making its directory)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
