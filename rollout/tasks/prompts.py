"""Task prompts from commit messages: subject + body, without what the agent cannot follow, and the heuristics that
reject commits whose message is no request.

Dropped (the agent has no network and no issue tracker): URLs; issue and pull-request references (`#123`,
`owner/repo#123`, `GH-123`, `PR 123`, `issue #123`, `pull request 123`); trailer lines (`Signed-off-by:`, `Co-
authored-by:`, `Change-Id:` ...); a leading "Fix #12:" / "#12 -"; a bracketed aside holding a reference ("(see
#12)", "(#1234)"); and lines left with only linking words ("Fixes", "See also:", "Closes"). Commit shas stay: the
workspace holds the history, so they can be followed.

Rejected: a revert of a commit in the same set (`reverted_commit`; its task would be the inverse of another one),
and a prompt with fewer than `min_words` words of at least two letters once references are dropped (e.g. "Issue:
#898", "Fix #12", "wip"): the request is elsewhere, not in the message.
"""

from __future__ import annotations

import re

_URL = re.compile(r"<?https?://\S+>?")
_REF = re.compile(r"(?:\b[\w.-]+/[\w.-]+)?#\d+\b|\bGH-\d+\b|\b(?:PR|pull request|issue|bug|ticket)\s*#?\d+\b",
                  re.IGNORECASE)
_TRAILER = re.compile(r"^[A-Za-z][\w-]*-(?:by|id|Id)\s*:|^Change-Id:", re.IGNORECASE)
_LINKING = {"fix", "fixes", "fixed", "close", "closes", "closed", "resolve", "resolves", "resolved", "ref", "refs",
            "see", "also", "related", "to", "issue", "issues", "pr", "and", "in", "for", "part", "of", "cf", "via"}
_GONE = "\x00"  # where a reference was
_REF_BRACKETS = re.compile(r"\([^()\n]*\x00[^()\n]*\)|\[[^\[\]\n]*\x00[^\[\]\n]*\]")  # "(see #12)", "[#3, #4]"
_REVERTS = re.compile(r"This reverts commit ([0-9a-f]{7,40})", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z]{2,}")


def _drop_lead(m: re.Match) -> str:
  return "" if (m.group(1) or "").strip().lower() in _LINKING | {""} else m.group(0)


def _clean_line(line: str) -> str:
  line = _REF_BRACKETS.sub("", _REF.sub(_GONE, _URL.sub(_GONE, line)))
  line = re.sub(r"^\s*([A-Za-z]+\s*)?\x00\s*[:-]\s*", _drop_lead, line).replace(_GONE, "")  # "Fix #387: ..."
  line = re.sub(r"\s+([:,;.])", r"\1", re.sub(r"\s+", " ", line)).strip(" ,;")
  if all(w.lower() in _LINKING for w in _WORD.findall(line)):
    return ""  # nothing but linking words (or punctuation) left
  return line


def prompt_from_message(subject: str, body: str = "", max_chars: int = 2000) -> str:
  """The prompt: cleaned subject, a blank line, the cleaned body paragraphs; cut to `max_chars`."""
  lines = [_clean_line(subject), ""]
  for raw in body.splitlines():
    if _TRAILER.match(raw.strip()) or _REVERTS.search(raw):
      continue
    lines.append(_clean_line(raw) if raw.strip() else "")
  text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
  return text if len(text) <= max_chars else text[:max_chars - 3] + "..."


def not_self_contained(prompt: str, min_words: int) -> str:
  """Why the prompt is not a self-contained request, or ""."""
  n = len(_WORD.findall(prompt))
  if n < min_words:
    return f"prompt not self-contained ({n} words after dropping references < min_prompt_words={min_words})"
  return ""


def reverted_commit(subject: str, body: str) -> str:
  """The sha a revert commit names ("This reverts commit <sha>"), or ""."""
  m = _REVERTS.search(body) or (_REVERTS.search(subject) if subject.startswith("Revert") else None)
  return m.group(1) if m else ""
