"""The one adapter between the harness and execution: workspaces (a sandbox over a directory tree) and snapshots.

Everything in `rollout/` runs commands and touches files only through `Workspace` and `WorkspaceFactory`, so a
change in the `sandboxes` API is a fix in this file alone. Both factories are `sandboxes` backends:

  SandboxFactory   bubblewrap namespaces, limits, overlay snapshot/fork (the default; what RL and evaluation use)
  LocalFactory     `sandboxes.UnsafeLocalBackend`: plain directory copies + host processes, NO isolation (for tests
                   of trusted, generated code, and machines without Linux namespaces)

Paths given to workspaces are relative to the workspace root; absolute paths or `..` that escape it are rejected
with a `ValueError` (tools turn that into an error message for the model).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import sandboxes


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

  def delete_snapshot(self, snapshot) -> None:
    """Releases a snapshot nothing will fork again; workspaces forked from it keep their files."""
    raise NotImplementedError

  def close(self) -> None:
    raise NotImplementedError


# ----------------------------------------------------------------------------------------------------------------
# `sandboxes` backends.


class SandboxWorkspace(Workspace):
  """A `sandboxes.Sandbox` behind the Workspace interface."""

  def __init__(self, sandbox):
    self.sb = sandbox

  def run(self, command: str, timeout_s: float = 30.0, output_limit: int = 1 << 16) -> CommandResult:
    res = self.sb.run(command, timeout=timeout_s)
    # One stream for the model, like a terminal; stdout first because most tools write their result there.
    text = res.stdout_text + (("\n" if res.stdout and not res.stdout.endswith(b"\n") else "") + res.stderr_text
                              if res.stderr else "")
    if res.limit_hit:
      text += f"\n[sandbox {res.limit_hit} limit hit]"
    text, cut = cap_text(text, output_limit)
    return CommandResult(res.exit_code, text, cut or res.stdout_truncated or res.stderr_truncated, res.timed_out,
                         res.wall_s)

  def read_file(self, path: str) -> str:
    return self.sb.read_file(safe_relpath(path)).decode("utf-8", errors="replace")

  def write_file(self, path: str, text: str) -> None:
    self.sb.write_file(safe_relpath(path), text)

  def list_dir(self, path: str = ".") -> list[str]:
    rel = safe_relpath(path)
    if not self.sb.exists(rel):
      raise FileNotFoundError(f"no such directory: {path!r}")
    res = self.sb.run(["ls", "-1Ap", "--", rel], timeout=10)  # -p marks directories with '/'
    if res.exit_code != 0:
      raise OSError(res.stderr_text.strip() or f"cannot list {path!r}")
    return sorted(res.stdout_text.splitlines())

  def exists(self, path: str) -> bool:
    return self.sb.exists(safe_relpath(path))

  def close(self) -> None:
    self.sb.close()


class SandboxFactory(WorkspaceFactory):
  """Workspaces are `sandboxes` sandboxes (default: bubblewrap namespaces); the Python environment that runs this
  code (its venv) is bound read-only inside and first on PATH, so `python -m pytest` and `python -m ruff` work.

  Args:
    backend: a `sandboxes` backend name ("bwrap", or "unsafe-local": see `LocalFactory`).
    venv: Python environment bound in (None: only the base Python).
    ro_binds: more host paths visible read-only at the same path (e.g. a wheel directory).
    path_prefix: more directories put first on PATH.
    backend_options: keyword arguments for the backend itself (e.g. `state_root`).
    **sandbox_kwargs: more `sandboxes.SandboxConfig` fields (limits, output_limit_bytes, ...).
  """

  def __init__(self, backend: str = "bwrap", venv: str | None = sys.prefix, ro_binds: tuple[str, ...] = (),
               path_prefix: tuple[str, ...] = (), backend_options: dict | None = None, **sandbox_kwargs):
    venvs = (venv,) if venv and venv != sys.base_prefix else ()
    config = sandboxes.SandboxConfig.make(
      ro_binds=venvs + tuple(ro_binds), path_prefix=tuple(os.path.join(v, "bin") for v in venvs) + tuple(path_prefix),
      env={"PYTHONDONTWRITEBYTECODE": "1"}, **sandbox_kwargs)
    self.backend = sandboxes.make_backend(backend, config=config, **(backend_options or {}))

  def snapshot_from_dir(self, directory: str):
    if not os.path.isdir(directory):
      raise FileNotFoundError(f"snapshot source {directory!r} is not a directory")
    return self.backend.import_dir(directory)

  def fork(self, snapshot) -> SandboxWorkspace:
    if not isinstance(snapshot, sandboxes.Snapshot):
      raise ValueError(f"not a snapshot of this factory: {snapshot!r}")
    return SandboxWorkspace(self.backend.fork(snapshot))

  def snapshot(self, workspace: Workspace):
    if not isinstance(workspace, SandboxWorkspace):
      raise TypeError(f"{type(self).__name__} cannot snapshot a {type(workspace).__name__}")
    return workspace.sb.snapshot()

  def delete_snapshot(self, snapshot) -> None:
    self.backend.delete_snapshot(snapshot)

  def close(self) -> None:
    self.backend.close()


class LocalFactory(SandboxFactory):
  """`sandboxes.UnsafeLocalBackend` behind the same interface: snapshots and forks are directory copies under
  `root`, commands run on the host (in their own session, with rlimits) with `python`'s directory first on PATH.

  There is NO isolation (network, every file the caller can touch): for tests and trusted, generated code only.
  Chosen by name, so it does not repeat the backend's warning.
  """

  def __init__(self, root: str | None = None, python: str = sys.executable):
    super().__init__("unsafe-local", venv=None, path_prefix=(os.path.dirname(python),),
                     backend_options={"state_root": root, "warn": False})


def make_factory(kind: str = "sandbox", **kwargs) -> WorkspaceFactory:
  """A factory by name: 'sandbox' (the `sandboxes` package, isolated) or 'local' (no isolation)."""
  factories = {"local": LocalFactory, "sandbox": SandboxFactory}
  if kind not in factories:
    raise ValueError(f"unknown workspaces {kind!r}; valid: {sorted(factories)}")
  return factories[kind](**kwargs)
