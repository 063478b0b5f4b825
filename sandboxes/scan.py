"""Scans of a fork's overlay upper dir (only what the fork changed): disk usage and files at the size limit."""

from __future__ import annotations

import os


def tree_bytes(root: str, stop_above: int) -> int:
  """Disk usage (allocated blocks) of a tree; stops counting once above `stop_above`."""
  total = 0
  stack = [root]
  while stack and total <= stop_above:
    try:
      it = os.scandir(stack.pop())
    except OSError:
      continue
    with it:
      for e in it:
        try:
          st = e.stat(follow_symlinks=False)
        except OSError:
          continue
        total += st.st_blocks * 512
        if e.is_dir(follow_symlinks=False):
          stack.append(e.path)
  return total


def files_at_size(root: str, size: int, max_entries: int = 20_000) -> set[tuple[str, int]]:
  """(path, mtime_ns) of regular files under `root` (the overlay upper: only what changed) of exactly `size` bytes."""
  found = set()
  seen = 0
  stack = [root]
  while stack and seen < max_entries:
    try:
      it = os.scandir(stack.pop())
    except OSError:
      continue
    with it:
      for e in it:
        seen += 1
        if e.is_dir(follow_symlinks=False):
          stack.append(e.path)
        elif e.is_file(follow_symlinks=False):
          st = e.stat(follow_symlinks=False)
          if st.st_size == size:
            found.add((e.path, st.st_mtime_ns))
  return found
