"""The backend-independent interface: a `Backend` makes snapshots and forks `Sandbox`es from them.

Every backend (bubblewrap namespaces, the unsafe local one, a future microVM one) implements these two classes;
callers only use the methods defined here.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Mapping, Sequence

from sandboxes import fsops
from sandboxes.types import RunResult, SandboxClosedError, SandboxConfig, Snapshot


class Sandbox(abc.ABC):
  """One isolated, writable workspace forked from a snapshot. Use as a context manager or call `close()`.

  Methods are thread-safe but serialized per sandbox: one command (or file operation) at a time.
  """

  def __init__(self, config: SandboxConfig):
    self.config = config
    self._lock = threading.RLock()
    self._closed = False
    self._owner: tuple[int, int] | None = None  # (uid, gid) host files written for the sandbox get

  # -- commands --------------------------------------------------------------------------------------------
  @abc.abstractmethod
  def run(
    self, cmd: str | Sequence[str], timeout: float = 60.0, stdin: bytes | None = None,
    env: Mapping[str, str] | None = None,
  ) -> RunResult:
    """Runs a command in the workspace and waits for it.

    Args:
      cmd: a shell string (run with `bash -c`, or `sh -c` where bash is missing) or an argv list.
      timeout: wall-clock seconds; the whole process tree is killed when it expires.
      stdin: bytes fed to the command's stdin; None for /dev/null.
      env: extra environment variables for this command only.

    Returns:
      A `RunResult`. Nothing the command does (or leaves running) outlives the call.
    """

  # -- state -----------------------------------------------------------------------------------------------
  @abc.abstractmethod
  def snapshot(self) -> Snapshot:
    """Freezes the current workspace into a `Snapshot` that the backend can `fork` any number of times."""

  @abc.abstractmethod
  def _root(self) -> str:
    """The host directory that holds the live workspace."""

  @abc.abstractmethod
  def _close(self) -> None:
    """Backend-specific tear-down; called once."""

  # -- files (host side; paths are relative to the workspace or absolute under /workspace) -----------------
  def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
    with self._lock:
      self._check_open()
      return fsops.read_file(self._root(), path, max_bytes)

  def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
    """Writes (creating parent dirs); a str is UTF-8 encoded."""
    with self._lock:
      self._check_open()
      fsops.write_file(self._root(), path, data, mode, self._owner)

  def list_dir(self, path: str = ".") -> list[str]:
    """Sorted names in a workspace directory."""
    with self._lock:
      self._check_open()
      return fsops.list_dir(self._root(), path)

  def remove(self, path: str) -> None:
    """Removes a file, symlink or directory tree."""
    with self._lock:
      self._check_open()
      fsops.remove(self._root(), path)

  def exists(self, path: str) -> bool:
    with self._lock:
      self._check_open()
      return os.path.lexists(fsops.resolve_in_root(self._root(), path))

  # -- lifetime --------------------------------------------------------------------------------------------
  @property
  def closed(self) -> bool:
    return self._closed

  def _check_open(self) -> None:
    if self._closed:
      raise SandboxClosedError("sandbox is closed")

  def close(self) -> None:
    """Kills anything running, unmounts and deletes the workspace. Idempotent."""
    with self._lock:
      if not self._closed:
        self._closed = True
        self._close()

  def __enter__(self) -> Sandbox:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class Backend(abc.ABC):
  """Makes snapshots and sandboxes. Use as a context manager or call `close()` (removes everything it made)."""

  name: str

  @abc.abstractmethod
  def import_dir(self, base_dir: str) -> Snapshot:
    """Copies a host directory (an environment, e.g. a checked-out repository) into an immutable snapshot."""

  @abc.abstractmethod
  def fork(self, snapshot: Snapshot, config: SandboxConfig | None = None) -> Sandbox:
    """A new independent sandbox whose workspace starts as `snapshot`."""

  @abc.abstractmethod
  def close(self) -> None:
    """Closes every sandbox and deletes every snapshot this backend made. Idempotent."""

  def create(self, base_dir: str, config: SandboxConfig | None = None) -> Sandbox:
    """`fork(import_dir(base_dir))`: a sandbox whose workspace starts as a copy of `base_dir`."""
    return self.fork(self.import_dir(base_dir), config)

  def __enter__(self) -> Backend:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
