"""What a unified diff changes, independent of where it sits: reverts, re-lands and cherry-picks are found by their
diffs, never by their commit messages.

A diff's *change* is, per file, the ordered list of its change blocks (the lines a block removes, the lines it adds);
index lines, hunk line numbers and context lines are left out, so a commit that undoes another one some commits
later (different context, different line numbers, a message without "This reverts commit") still has exactly the
inverse change: the same blocks with removed and added lines swapped. Text is compared byte for byte (whitespace
counts: it is code).

`family_key(diff)` is the same for a diff, its inverse and any copy of either: tasks sharing it are one change seen
twice, and must land on one side of a train / held-out split.
"""

from __future__ import annotations

import hashlib
import json
import re

Change = dict[str, list[tuple[tuple[str, ...], tuple[str, ...]]]]  # path -> [(removed lines, added lines)]
_FILE = re.compile(r"^diff --git a/(.*) b/(.*)$")


def change_of(diff: str) -> Change:
  """The change blocks of every file `diff` touches (see the module docstring)."""
  out: Change = {}
  path, removed, added, in_hunk = None, [], [], False

  def close_block():
    if path is not None and (removed or added):
      out[path].append((tuple(removed), tuple(added)))
    removed.clear()
    added.clear()

  for line in diff.splitlines():
    m = _FILE.match(line)
    if m:
      close_block()
      path, in_hunk = m.group(2), False
      out.setdefault(path, [])
    elif line.startswith("@@"):
      close_block()
      in_hunk = True
    elif not in_hunk or path is None:
      if line.startswith("Binary files"):  # no lines to compare: the file's name stands for its change
        out.setdefault(path or "", []).append(((line,), ()))
    elif line.startswith("-"):
      if added:  # a removal after additions starts a new block
        close_block()
      removed.append(line[1:])
    elif line.startswith("+"):
      added.append(line[1:])
    elif line.startswith("\\"):  # "\ No newline at end of file" belongs to the line before it
      side = added if added else removed
      if side:
        side[-1] += "\n\\"
    else:
      close_block()
  close_block()
  return out


def inverse(change: Change) -> Change:
  """The change that undoes `change`."""
  return {p: [(a, r) for r, a in blocks] for p, blocks in change.items()}


def fingerprint(change: Change) -> str:
  """A sha256 of the change; "" when it changes no line (e.g. a mode change only), which then matches nothing."""
  if not any(change.values()):
    return ""
  return hashlib.sha256(json.dumps(sorted(change.items())).encode()).hexdigest()


def family_key(diff: str) -> str:
  """One key for a diff, its inverse and their copies ("" for a diff changing no line)."""
  change = change_of(diff)
  return min(fingerprint(change), fingerprint(inverse(change)))
