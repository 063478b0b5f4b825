"""Scans of a fork's overlay upper dir (only what the fork changed): disk usage, files at the size limit, and
setuid/setgid bits to drop before it becomes a layer."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator


def _entries(root: str) -> Iterator[os.DirEntry]:
  """Every entry below `root`, depth first, without following symlinks (iteratively: no depth limit); unreadable
  dirs are skipped."""
  stack = [root]
  while stack:
    try:
      it = os.scandir(stack.pop())
    except OSError:
      continue
    with it:
      for e in it:
        if e.is_dir(follow_symlinks=False):
          stack.append(e.path)
        yield e


def tree_bytes(root: str, stop_above: int) -> int:
  """Disk usage (allocated blocks) of a tree; stops counting once above `stop_above`."""
  total = 0
  for e in _entries(root):
    if total > stop_above:
      break
    try:
      total += e.stat(follow_symlinks=False).st_blocks * 512
    except OSError:
      continue
  return total


def files_at_size(root: str, size: int, max_entries: int = 20_000) -> set[tuple[str, int]]:
  """(path, mtime_ns) of regular files under `root` (the overlay upper: only what changed) of exactly `size` bytes."""
  found = set()
  seen = 0
  for e in _entries(root):
    if seen >= max_entries:
      break
    seen += 1
    if e.is_file(follow_symlinks=False):
      st = e.stat(follow_symlinks=False)
      if st.st_size == size:
        found.add((e.path, st.st_mtime_ns))
  return found


def drop_setid_bits(root: str) -> None:
  """Clears setuid/setgid on every regular file under `root` (a new layer).

  Inside a sandbox they never act (every mount there is `nosuid`), so a snapshot loses nothing, but a layer is a
  directory on the host: a setuid file kept in it would run as the sandbox's host uid for whoever reaches it.
  (Directories keep setgid: it only chooses the group of new entries.)
  """
  for e in _entries(root):
    try:
      st = e.stat(follow_symlinks=False)
    except OSError:
      continue
    if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and stat.S_ISREG(st.st_mode):
      os.chmod(e.path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))  # a regular file: no link to follow
