"""The agent's tools, run against a `Workspace`. Bad calls return an error result the model sees; nothing raises.

Tools (arguments; * = required):
  read_file   path*, start, end          file text (1-based inclusive line range), optionally line-numbered
  list_dir    path                       directory entries, directories end with '/'
  grep        pattern*, path             `grep -rnE` matches, as path:line:text
  edit        path*, old*, new*          replace the one exact occurrence of `old` with `new`
  write_file  path*, content*            create or overwrite a file
  shell       command*, timeout          run a shell command in the workspace root (exit code + capped output)
  todo        write, add, update, done   a todo list: replace it, append items, rename items {id: text}, complete ids
  finish      message                    end the episode with a final message to the user
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from collections.abc import Callable
from typing import Any

from rollout.chat_format import ToolCall
from rollout.workspace import Workspace, cap_text, safe_relpath


@dataclasses.dataclass(frozen=True)
class ToolConfig:
  """Tool limits.

  Attributes:
    max_output_chars: every tool result is cut to this many characters (head and tail kept).
    shell_timeout_s: default timeout of `shell`; a requested timeout is clipped to max_shell_timeout_s.
    max_shell_timeout_s: upper bound on any shell timeout.
    number_lines: read_file prefixes lines with their numbers (costs tokens; off at Colab scale).
  """
  max_output_chars: int = 2000
  shell_timeout_s: float = 10.0
  max_shell_timeout_s: float = 60.0
  number_lines: bool = False


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """What a tool call returned: `text` for the model, whether it was an error, time taken, and episode end."""
  name: str
  text: str
  error: bool
  wall_s: float
  invalid: bool = False  # the call was malformed (unknown tool / bad arguments), not merely unsuccessful
  finished: bool = False
  final_message: str = ""


class ToolError(Exception):
  """A problem with the call the model should read (raised inside tools, turned into an error result)."""


class InvalidCallError(ToolError):
  """The call itself is wrong (unknown tool, missing/unknown/mistyped argument): counted as malformed."""


@dataclasses.dataclass(frozen=True)
class _Spec:
  fn: Callable[..., str]
  required: dict[str, type | tuple[type, ...]]
  optional: dict[str, type | tuple[type, ...]]


class TodoList:
  """Ordered items with a done flag; ids are 1-based positions."""

  def __init__(self):
    self.items: list[list[Any]] = []  # [text, done]

  def render(self) -> str:
    if not self.items:
      return "(todo list empty)"
    return "\n".join(f"{i}. [{'x' if done else ' '}] {text}" for i, (text, done) in enumerate(self.items, 1))

  @property
  def unfinished(self) -> int:
    return sum(not done for _, done in self.items)

def _todo_id(raw, n: int) -> int:
  """0-based index of a 1-based todo id, or a ToolError the model can read."""
  if isinstance(raw, bool) or not isinstance(raw, int | str):
    raise ToolError(f"todo id {raw!r} is not an integer")
  try:
    i = int(raw)
  except ValueError:
    raise ToolError(f"todo id {raw!r} is not an integer") from None
  if not 1 <= i <= n:
    raise ToolError(f"todo id {i} does not exist (list has {n} items)")
  return i - 1


class ToolBox:
  """The tools bound to one workspace and one todo list; `call` dispatches a parsed ToolCall."""

  def __init__(self, workspace: Workspace, cfg: ToolConfig = ToolConfig()):
    self.ws = workspace
    self.cfg = cfg
    self.todo = TodoList()
    # Files changed through edit / write_file -> their text before the first change (None: new file); the lint
    # reward compares findings before and after.
    self.originals: dict[str, str | None] = {}
    s = str
    self.specs: dict[str, _Spec] = {
      "read_file": _Spec(self._read_file, {"path": s}, {"start": int, "end": int}),
      "list_dir": _Spec(self._list_dir, {}, {"path": s}),
      "grep": _Spec(self._grep, {"pattern": s}, {"path": s}),
      "edit": _Spec(self._edit, {"path": s, "old": s, "new": s}, {}),
      "write_file": _Spec(self._write_file, {"path": s, "content": s}, {}),
      "shell": _Spec(self._shell, {"command": s}, {"timeout": (int, float)}),
      "todo": _Spec(self._todo, {}, {"write": list, "add": list, "update": dict, "done": list}),
      "finish": _Spec(self._finish, {}, {"message": s}),
    }

  def call(self, call: ToolCall) -> ToolResult:
    """Runs one tool call; unknown tools, bad arguments and tool failures become error results."""
    start = time.perf_counter()
    finished, message, invalid = False, "", False
    try:
      spec = self.specs.get(call.name)
      if spec is None:
        raise InvalidCallError(f"unknown tool {call.name!r}; available: {', '.join(self.specs)}")
      args = self._check_args(call.name, spec, call.arguments)
      if call.name == "finish":
        finished, message = True, args.get("message", "")
      text, error = spec.fn(**args), False
    except ToolError as e:
      text, error, invalid = f"error: {e}", True, isinstance(e, InvalidCallError)
    except (OSError, ValueError, UnicodeError) as e:  # e.g. a missing file or a path outside the workspace
      text, error = f"error: {type(e).__name__}: {e}", True
    text, _ = cap_text(text, self.cfg.max_output_chars)
    return ToolResult(call.name, text, error, time.perf_counter() - start, invalid, finished and not error, message)

  @staticmethod
  def _check_args(name: str, spec: _Spec, arguments: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(arguments) - set(spec.required) - set(spec.optional))
    if unknown:
      takes = sorted({**spec.required, **spec.optional})
      raise InvalidCallError(f"{name} got unknown arguments {unknown}; it takes {takes}")
    missing = sorted(set(spec.required) - set(arguments))
    if missing:
      raise InvalidCallError(f"{name} is missing required arguments {missing}")
    for key, value in arguments.items():
      want = {**spec.required, **spec.optional}[key]
      if isinstance(value, bool) or not isinstance(value, want):
        names = want.__name__ if isinstance(want, type) else " or ".join(t.__name__ for t in want)
        raise InvalidCallError(f"{name} argument {key!r} must be {names}, got {type(value).__name__}")
    return arguments

  # ---- tools --------------------------------------------------------------------------------------------------

  def _read_file(self, path: str, start: int = 1, end: int | None = None) -> str:
    lines = self.ws.read_file(path).splitlines(keepends=True)
    if start < 1 or (end is not None and end < start):
      raise ToolError(f"bad line range start={start} end={end}; lines are 1-based and end >= start")
    chosen = lines[start - 1:end]
    if not chosen and lines:
      raise ToolError(f"start={start} is past the end of {path} ({len(lines)} lines)")
    if self.cfg.number_lines:
      return "".join(f"{i:>4} {line}" for i, line in enumerate(chosen, start))
    return "".join(chosen)

  def _list_dir(self, path: str = ".") -> str:
    return "\n".join(e for e in self.ws.list_dir(path) if e != ".git/") or "(empty)"

  def _grep(self, pattern: str, path: str = ".") -> str:
    rel = safe_relpath(path)
    res = self.ws.run(f"grep -rnE --exclude-dir=.git -e {shlex.quote(pattern)} -- {shlex.quote(rel)}",
                      timeout_s=self.cfg.shell_timeout_s, output_limit=self.cfg.max_output_chars)
    if res.exit_code == 1:
      return "(no matches)"
    if not res.ok:
      raise ToolError(f"grep failed: {res.output.strip()[:300]}")
    return "".join(line[2:] if line.startswith("./") else line for line in res.output.splitlines(keepends=True))

  def _edit(self, path: str, old: str, new: str) -> str:
    if not old:
      raise ToolError("edit needs a non-empty 'old' string; use write_file to create a file")
    if old == new:
      raise ToolError("'old' and 'new' are identical; the edit would change nothing")
    text = self.ws.read_file(path)
    n = text.count(old)
    if n == 0:
      raise ToolError(f"'old' text not found in {path}; read the file and copy the exact text (spaces included)")
    if n > 1:
      raise ToolError(f"'old' text occurs {n} times in {path}; include more surrounding lines to make it unique")
    self.originals.setdefault(safe_relpath(path), text)
    self.ws.write_file(path, text.replace(old, new, 1))
    return f"edited {path}"

  def _write_file(self, path: str, content: str) -> str:
    rel = safe_relpath(path)
    if rel not in self.originals:
      self.originals[rel] = self.ws.read_file(rel) if self.ws.exists(rel) else None
    self.ws.write_file(path, content)
    return f"wrote {path} ({len(content.splitlines())} lines)"

  def _shell(self, command: str, timeout: float | None = None) -> str:
    t = min(float(timeout or self.cfg.shell_timeout_s), self.cfg.max_shell_timeout_s)
    if t <= 0:
      raise ToolError(f"timeout must be positive, got {timeout}")
    res = self.ws.run(command, timeout_s=t, output_limit=self.cfg.max_output_chars)
    status = f"timed out after {t:g}s" if res.timed_out else f"exit code {res.exit_code}"
    return f"{status}\n{res.output}" if res.output else status

  def _todo(self, write: list | None = None, add: list | None = None, update: dict | None = None,
            done: list | None = None) -> str:
    if write is None and add is None and update is None and done is None:
      return self.todo.render()
    for items in (write, add):
      if items is not None and not all(isinstance(t, str) and t for t in items):
        raise ToolError("todo items must be non-empty strings")
    # Work on a copy so that a bad id or text leaves the list as it was.
    items = [[t, False] for t in write] if write is not None else [list(i) for i in self.todo.items]
    items += [[t, False] for t in add or []]
    for key, text in (update or {}).items():
      if not isinstance(text, str) or not text:
        raise ToolError(f"todo update for id {key} must be a non-empty string")
      items[_todo_id(key, len(items))][0] = text
    for key in done or []:
      items[_todo_id(key, len(items))][1] = True
    self.todo.items = items
    return self.todo.render()

  def _finish(self, message: str = "") -> str:
    return "finished"
