"""UNSAFE: runs commands directly on the host, for platforms without Linux namespaces (e.g. macOS laptops).

There is no isolation at all: commands see the network and every file the caller can read or write, and a
`setsid` child escapes the kill. Forks and snapshots are full directory copies (slow for big trees). It exists
so that tests of the *harness* can run anywhere; it is never chosen automatically.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings

from sandboxes import fsops, limits
from sandboxes.process import run_process
from sandboxes.sandbox import Backend, Sandbox, result_from
from sandboxes.types import RunResult, SandboxConfig, SandboxError, Snapshot


def _copy(src: str, dst: str) -> None:
  # shutil, not `cp -a --reflink`: this backend is for hosts such as macOS whose cp lacks GNU options.
  shutil.copytree(src, dst, symlinks=True)


class UnsafeLocalBackend(Backend):
  """Host execution with rlimits only and copy-based snapshots. Not a security boundary.

  Args:
    config: default `SandboxConfig` (`ro_binds` and `network` have no effect here).
    state_root: where copies live (default: a new temp dir, removed on close).
    warn: emit the "no isolation" RuntimeWarning (callers that chose this backend by name may silence it).
  """

  name = "unsafe-local"

  def __init__(self, config: SandboxConfig | None = None, state_root: str | None = None, warn: bool = True):
    super().__init__(config)
    if warn:
      warnings.warn("UnsafeLocalBackend runs model-written commands on the host WITHOUT isolation", RuntimeWarning,
                    stacklevel=2)
    if state_root is not None:
      os.makedirs(state_root, exist_ok=True)
    self.path = tempfile.mkdtemp(prefix="composer_unsafe_local_", dir=state_root)
    self._n = 0

  def _new_dir(self, kind: str) -> str:
    with self._lock:
      self._check_open()
      self._n += 1
      return os.path.join(self.path, f"{kind}{self._n}")

  def import_dir(self, base_dir: str) -> Snapshot:
    if not isinstance(base_dir, str | os.PathLike) or not os.path.isdir(base_dir):
      raise FileNotFoundError(f"base directory {base_dir!r} does not exist or is not a directory")
    d = self._new_dir("snap")
    _copy(os.fspath(base_dir), d)
    return Snapshot(self.name, (d,), os.path.basename(d))

  def fork(self, snapshot: Snapshot, config: SandboxConfig | None = None) -> LocalSandbox:
    if not isinstance(snapshot, Snapshot) or snapshot.backend != self.name \
       or os.path.dirname(snapshot.layers[0]) != self.path:
      raise SandboxError(f"snapshot {snapshot!r} was not made by this backend instance")
    d = self._new_dir("sb")
    _copy(snapshot.layers[0], os.path.join(d, "ws"))
    os.makedirs(os.path.join(d, "tmp"))
    sb = LocalSandbox(self, d, config or self.config)
    self._track(sb)
    return sb

  def delete_snapshot(self, snapshot: Snapshot) -> None:
    """Deletes a snapshot's copy (forks made from it are independent copies and stay)."""
    if snapshot.backend != self.name or os.path.dirname(snapshot.layers[0]) != self.path \
       or not os.path.isdir(snapshot.layers[0]):
      raise SandboxError(f"unknown snapshot {snapshot.snapshot_id}: already deleted, or not made by this backend")
    fsops.rmtree(snapshot.layers[0])

  def _close(self) -> None:
    fsops.rmtree(self.path)


class LocalSandbox(Sandbox):
  """A workspace directory on the host; commands run in a new session (process group) with rlimits."""

  def __init__(self, backend: UnsafeLocalBackend, path: str, config: SandboxConfig):
    super().__init__(config)
    self.backend = backend
    self.path = path
    self.workspace = os.path.join(path, "ws")

  def _root(self) -> str:
    return self.workspace

  def _run(self, argv: list[str], timeout: float, stdin: bytes | None, env: dict[str, str]) -> RunResult:
    tmp = os.path.join(self.path, "tmp")
    path = ":".join(list(self.config.path_prefix) + [os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    full_env = {"HOME": tmp, "TMPDIR": tmp, "PATH": path, "LANG": "C.UTF-8", "WORKSPACE": self.workspace}
    full_env.update(dict(self.config.env))
    full_env.update(env)
    # No pids cgroup here; RLIMIT_NPROC would count all of the caller's processes, so it is not set either.
    rl = limits.rlimits_for(self.config.limits, {"pids"})

    def kill(proc: subprocess.Popen) -> None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)  # the command's session; setsid'd grandchildren escape (unsafe)
      except ProcessLookupError:
        pass

    prlimit = limits.rlimits_argv(rl)
    if prlimit is not None:
      argv, popen_kw = prlimit + argv, {}
    else:  # e.g. macOS: a preexec_fn (a real fork(); unsafe in a multithreaded caller, but there is no other way)
      popen_kw = {"preexec_fn": limits.make_preexec([], rl)}
    try:
      out = run_process(argv, timeout=timeout, output_limit=self.config.output_limit_bytes, kill=kill, stdin=stdin,
                        poll=self._poll_closed, cwd=self.workspace, env=full_env, start_new_session=True,
                        **popen_kw)
    except FileNotFoundError as e:  # an argv command that does not exist: report it like a shell would
      return RunResult(127, b"", f"{e}\n".encode(), False, False, 0.0, False, None)
    return result_from(out)

  def snapshot(self) -> Snapshot:
    with self._lock:
      self._check_open()
      d = self.backend._new_dir("snap")
      _copy(self.workspace, d)
      return Snapshot(self.backend.name, (d,), os.path.basename(d))

  def _close(self) -> None:
    fsops.rmtree(self.path)
