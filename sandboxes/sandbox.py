"""The backend-independent interface: a `Backend` makes snapshots and forks `Sandbox`es from them.

Every backend (bubblewrap namespaces, the unsafe local one, a future microVM one) implements these two classes;
callers only use the methods defined here. What all backends share lives here once: argument checks, the
serializing lock, idempotent close (a close from another thread kills the running command instead of waiting
for it), the backend's set of live sandboxes, and turning a process outcome into a `RunResult`.
"""

from __future__ import annotations

import abc
import dataclasses
import signal
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence

from sandboxes import checks, fsops
from sandboxes.process import ProcessOutcome
from sandboxes.types import RunResult, SandboxClosedError, SandboxConfig, Snapshot

# 128+N is how a shell (and bwrap) reports a command killed by signal N (`run_process` reports it so).
_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu_time", signal.SIGXFSZ: "file_size"}


def result_from(out: ProcessOutcome, limit_hit: str | None = None) -> RunResult:
  """The `RunResult` of a finished process: exit code in shell convention and which limit (if any) stopped it.

  Args:
    out: what `run_process` saw.
    limit_hit: a limit the backend detected itself (cgroup counters, a full disk); wins over the exit status.
  """
  rc = out.result.exit_code
  if limit_hit is None and out.kill_reason not in (None, "timeout", "closed"):
    limit_hit = out.kill_reason  # what the backend's poll killed it for (e.g. "cpu_time")
  if limit_hit is None and rc is not None and rc > 128:
    limit_hit = _SIGNAL_LIMITS.get(rc - 128)
  return dataclasses.replace(out.result, limit_hit=limit_hit)


class Sandbox(abc.ABC):
  """One isolated, writable workspace forked from a snapshot. Use as a context manager or call `close()`.

  Methods are thread-safe but serialized per sandbox: one command (or file operation) at a time. `close()` from
  another thread does not wait for a running command: the command is killed (`exit_code=None`).
  """

  def __init__(self, config: SandboxConfig):
    self.config = config
    self._lock = threading.RLock()
    self._closed = False
    self._closing = False  # set (without the lock) by close(); the running command's poll sees it
    self._owner: tuple[int, int] | None = None  # (uid, gid) host files written for the sandbox get

  # -- commands --------------------------------------------------------------------------------------------
  def run(
    self, cmd: str | Sequence[str], timeout: float = 60.0, stdin: bytes | None = None,
    env: Mapping[str, str] | None = None,
  ) -> RunResult:
    """Runs a command in the workspace and waits for it.

    Args:
      cmd: a shell string (run with `bash -c`, or `sh -c` where bash is missing) or an argv list.
      timeout: wall-clock seconds (finite); the whole process tree is killed when it expires.
      stdin: bytes fed to the command's stdin; None for /dev/null.
      env: extra environment variables for this command only.

    Returns:
      A `RunResult`. Nothing the command does (or leaves running) outlives the call.

    Raises:
      ValueError / TypeError: a malformed argument, named in the message (never reported as a failing command).
    """
    argv = checks.run_args(cmd, timeout, stdin, env)
    with self._lock:
      self._check_open()
      return self._run(argv, timeout, stdin, dict(env or {}))

  @abc.abstractmethod
  def _run(self, argv: list[str], timeout: float, stdin: bytes | None, env: dict[str, str]) -> RunResult:
    """Backend-specific `run` with checked arguments (`argv` already wrapped in a shell); the lock is held."""

  def _poll_closed(self) -> str | None:
    """For `run_process(poll=...)`: "closed" once another thread called close()."""
    return "closed" if self._closing else None

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
  # Resolution is by directory fds and every open is O_NONBLOCK | O_NOFOLLOW, so no call can block on a FIFO or
  # be redirected by a symlink swapped in mid-call; the lock only serializes them with commands.
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
      return fsops.exists(self._root(), path)

  # -- lifetime --------------------------------------------------------------------------------------------
  @property
  def closed(self) -> bool:
    return self._closed

  def _check_open(self) -> None:
    if self._closed:
      raise SandboxClosedError("sandbox is closed")

  def close(self) -> None:
    """Kills anything running, unmounts and deletes the workspace. Idempotent."""
    self._closing = True  # seen by a running command's poll within 50 ms, so the lock below frees up
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

  def __init__(self, config: SandboxConfig | None):
    if config is not None and not isinstance(config, SandboxConfig):
      raise TypeError(f"config must be a SandboxConfig, got {type(config).__name__}")
    self.config = config or SandboxConfig()
    self._lock = threading.Lock()
    self._sandboxes: weakref.WeakSet[Sandbox] = weakref.WeakSet()
    self._closed = False

  @abc.abstractmethod
  def import_dir(self, base_dir: str) -> Snapshot:
    """Copies a host directory (an environment, e.g. a checked-out repository) into an immutable snapshot."""

  @abc.abstractmethod
  def fork(self, snapshot: Snapshot, config: SandboxConfig | None = None) -> Sandbox:
    """A new independent sandbox whose workspace starts as `snapshot`."""

  @abc.abstractmethod
  def _close(self) -> None:
    """Backend-specific tear-down after every live sandbox was closed; called once."""

  def create(self, base_dir: str, config: SandboxConfig | None = None) -> Sandbox:
    """`fork(import_dir(base_dir))`: a sandbox whose workspace starts as a copy of `base_dir`."""
    return self.fork(self.import_dir(base_dir), config)

  def _track(self, sb: Sandbox) -> None:
    with self._lock:
      self._sandboxes.add(sb)

  def _live(self) -> list[Sandbox]:
    with self._lock:
      return [sb for sb in self._sandboxes if not sb.closed]

  def _check_open(self) -> None:
    if self._closed:
      raise SandboxClosedError("backend is closed")

  def close(self) -> None:
    """Closes every sandbox and deletes every snapshot this backend made. Idempotent.

    A sandbox that fails to close is reported (a warning) and does not stop the others or the backend's own
    tear-down.
    """
    with self._lock:
      if self._closed:
        return
      self._closed = True
      live = list(self._sandboxes)
    for sb in live:
      try:
        sb.close()
      except Exception as e:  # noqa: BLE001 - one broken sandbox must not keep the rest alive
        warnings.warn(f"closing a sandbox failed: {e!r}", RuntimeWarning, stacklevel=2)
    self._close()

  def __enter__(self) -> Backend:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

