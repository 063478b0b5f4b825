"""The one adapter between the harness and execution: workspaces (a sandbox over a directory tree) and snapshots.

Everything in `rollout/` runs commands and touches files only through `Workspace` and `WorkspaceFactory`, so a
change in the `sandboxes` API is a fix in this file alone. Two backends:

  LocalFactory     plain directories + subprocess (no isolation; for tests of trusted, generated code)
  SandboxFactory   the `sandboxes` package (namespaces, limits, overlay snapshot/fork), when it is installed

Paths given to workspaces are relative to the workspace root; absolute paths or `..` that escape it are rejected
with a `ValueError` (tools turn that into an error message for the model).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid


@dataclasses.dataclass(frozen=True)
class CommandResult:
  """What one shell command did (output is stdout + stderr, decoded, capped)."""
  exit_code: int | None
  output: str
  truncated: bool
  timed_out: bool
  wall_s: float

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out


def cap_text(text: str, limit: int) -> tuple[str, bool]:
  """Keeps the head and tail of `text` within `limit` characters; returns (text, truncated)."""
  if len(text) <= limit:
    return text, False
  marker = f"\n...[{len(text) - limit} chars cut]...\n"
  keep = max(limit - len(marker), 0)
  return text[:keep // 2] + marker + text[len(text) - (keep - keep // 2):], True


def safe_relpath(path: str) -> str:
  """Normalises a workspace-relative path; raises ValueError if it escapes the workspace."""
  if not isinstance(path, str) or not path.strip():
    raise ValueError("path must be a non-empty string")
  p = path.strip()
  if p == "/workspace" or p.startswith("/workspace/"):  # the sandbox's own name for its root
    p = p[len("/workspace"):].lstrip("/") or "."
  norm = os.path.normpath(p)
  if os.path.isabs(norm) or norm == ".." or norm.startswith("../"):
    raise ValueError(f"path {path!r} is outside the workspace; use a path relative to the project root")
  return norm


class Workspace:
  """A running environment: files + a shell. Subclasses implement the primitives."""

  def run(self, command: str, timeout_s: float = 30.0, output_limit: int = 1 << 16) -> CommandResult:
    raise NotImplementedError

  def read_file(self, path: str) -> str:
    raise NotImplementedError

  def write_file(self, path: str, text: str) -> None:
    raise NotImplementedError

  def list_dir(self, path: str = ".") -> list[str]:
    """Entries of a directory, sorted, directories suffixed with '/'."""
    raise NotImplementedError

  def exists(self, path: str) -> bool:
    raise NotImplementedError

  def close(self) -> None:
    raise NotImplementedError


class WorkspaceFactory:
  """Makes snapshots (immutable environment states) and workspaces forked from them."""

  def snapshot_from_dir(self, directory: str):
    raise NotImplementedError

  def fork(self, snapshot) -> Workspace:
    raise NotImplementedError

  def snapshot(self, workspace: Workspace):
    """Freezes a workspace's current files as a new snapshot."""
    raise NotImplementedError

  def close(self) -> None:
    raise NotImplementedError


# ----------------------------------------------------------------------------------------------------------------
# Local backend: directories and subprocesses.


class LocalWorkspace(Workspace):
  """A private copy of a snapshot directory; commands run with it as cwd and `python` on PATH."""

  def __init__(self, root: str, python_bin_dir: str):
    self.root = root
    self._env = dict(os.environ, PATH=python_bin_dir + os.pathsep + os.environ.get("PATH", ""),
                     PYTHONDONTWRITEBYTECODE="1", HOME=root)
    self._env.pop("PYTHONPATH", None)
    self.closed = False

  def _abs(self, path: str) -> str:
    return os.path.join(self.root, safe_relpath(path))

  def run(self, command: str, timeout_s: float = 30.0, output_limit: int = 1 << 16) -> CommandResult:
    start = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", command], cwd=self.root, env=self._env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    timed_out = False
    try:
      out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      timed_out = True
      os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: the shell and what it started
      out, _ = proc.communicate()
    text, truncated = cap_text(out.decode("utf-8", errors="replace"), output_limit)
    return CommandResult(None if timed_out else proc.returncode, text, truncated, timed_out,
                         time.perf_counter() - start)

  def read_file(self, path: str) -> str:
    with open(self._abs(path), encoding="utf-8", errors="replace") as f:
      return f.read()

  def write_file(self, path: str, text: str) -> None:
    p = self._abs(path)
    os.makedirs(os.path.dirname(p) or self.root, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
      f.write(text)

  def list_dir(self, path: str = ".") -> list[str]:
    p = self._abs(path)
    return sorted(e + "/" if os.path.isdir(os.path.join(p, e)) else e for e in os.listdir(p))

  def exists(self, path: str) -> bool:
    return os.path.exists(self._abs(path))

  def close(self) -> None:
    if not self.closed:
      shutil.rmtree(self.root, ignore_errors=True)
      self.closed = True


class LocalFactory(WorkspaceFactory):
  """Snapshots are read-only directory copies under `root`; a fork is a full copy (fine for small projects)."""

  def __init__(self, root: str | None = None, python: str = sys.executable):
    self._own_root = root is None
    self.root = root or tempfile.mkdtemp(prefix="rollout_ws_")
    os.makedirs(self.root, exist_ok=True)
    self.python_bin_dir = os.path.dirname(python)

  def _new_dir(self, kind: str) -> str:
    return os.path.join(self.root, f"{kind}_{uuid.uuid4().hex[:12]}")

  def snapshot_from_dir(self, directory: str) -> str:
    if not os.path.isdir(directory):
      raise FileNotFoundError(f"snapshot source {directory!r} is not a directory")
    dest = self._new_dir("snap")
    shutil.copytree(directory, dest, symlinks=True)
    return dest

  def fork(self, snapshot: str) -> LocalWorkspace:
    if not isinstance(snapshot, str) or not os.path.isdir(snapshot):
      raise ValueError(f"not a snapshot of this factory: {snapshot!r}")
    dest = self._new_dir("ws")
    shutil.copytree(snapshot, dest, symlinks=True)
    return LocalWorkspace(dest, self.python_bin_dir)

  def snapshot(self, workspace: Workspace) -> str:
    if not isinstance(workspace, LocalWorkspace):
      raise TypeError(f"LocalFactory cannot snapshot a {type(workspace).__name__}")
    return self.snapshot_from_dir(workspace.root)

  def close(self) -> None:
    if self._own_root:
      shutil.rmtree(self.root, ignore_errors=True)


def make_factory(backend: str = "local", **kwargs) -> WorkspaceFactory:
  """A factory by name: 'local' (directories + subprocess)."""
  factories = {"local": LocalFactory}
  if backend not in factories:
    raise ValueError(f"unknown workspace backend {backend!r}; valid: {sorted(factories)}")
  return factories[backend](**kwargs)
