"""The default backend: bubblewrap (Linux namespaces) + overlayfs snapshots/forks + cgroup limits.

Each `run` starts a fresh bwrap: new user/pid/ipc/uts/net/mount/cgroup namespaces, unprivileged uid 1000 inside
with every capability dropped and nested user namespaces disabled, read-only system dirs, a private tmpfs /tmp,
and the fork's overlay mount bound read-write at /workspace. The bwrap process is placed in the sandbox's cgroups
before it execs, so every descendant is counted and limited; when the command exits (or is killed, or the caller
dies) the pid namespace ends and takes every process with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping, Sequence

from sandboxes import bwrap, limits, overlay
from sandboxes.process import run_process
from sandboxes.sandbox import Backend, Sandbox
from sandboxes.store import Store
from sandboxes.types import (
  BackendUnavailableError,
  RunResult,
  SandboxClosedError,
  SandboxConfig,
  SandboxError,
  Snapshot,
)


class BwrapBackend(Backend):
  """Namespaced sandboxes with overlayfs forks. Needs root (overlay mounts, cgroups) and bubblewrap >= 0.11.

  Args:
    config: default `SandboxConfig` for forks.
    state_root: host dir for layers and workspaces (default /tmp/composer_sandboxes); stale state of dead
      owners in it is cleaned up on start.
    max_layers: a snapshot deeper than this is flattened into one layer (also done whenever the mount options
      would not fit the kernel's one-page limit). Deep stacks slow every lookup, so keep it well under 500.
    bwrap_path: explicit bwrap binary (else see `bwrap.find_bwrap`).
  """

  name = "bwrap"

  def __init__(self, config: SandboxConfig | None = None, state_root: str | None = None, max_layers: int = 32,
               bwrap_path: str | None = None):
    if os.geteuid() != 0:
      raise BackendUnavailableError(
        "BwrapBackend needs root for overlay mounts and cgroups (rootless mode is not implemented); run as root, "
        "or explicitly choose the unsafe `UnsafeLocalBackend`.")
    if not 1 <= max_layers <= overlay.MAX_KERNEL_LAYERS:
      raise ValueError(f"{max_layers=} must be in [1, {overlay.MAX_KERNEL_LAYERS}]")
    self.bwrap = bwrap.find_bwrap(bwrap_path)
    self.config = config or SandboxConfig()
    self.max_layers = max_layers
    self.cgroup_parents = limits.detect_parents()
    self.store = Store(state_root)
    self._etc = os.path.join(self.store.path, "etc")
    os.makedirs(self._etc)
    for fname, text in bwrap.etc_files().items():
      with open(os.path.join(self._etc, fname), "w") as f:
        f.write(text)
    self._lock = threading.Lock()
    self._sandboxes: weakref.WeakSet[BwrapSandbox] = weakref.WeakSet()
    self._closed = False

  def import_dir(self, base_dir: str) -> Snapshot:
    if not isinstance(base_dir, str | os.PathLike) or not os.path.isdir(base_dir):
      raise FileNotFoundError(f"base directory {base_dir!r} does not exist or is not a directory")
    self._check_open()
    layer = self.store.new_layer_dir()
    overlay.copy_tree(os.fspath(base_dir), layer)
    return Snapshot(self.name, (layer,), os.path.basename(layer))

  def fork(self, snapshot: Snapshot, config: SandboxConfig | None = None) -> BwrapSandbox:
    self._check_open()
    if snapshot.backend != self.name or not all(self.store.owns_layer(p) for p in snapshot.layers):
      raise SandboxError(f"snapshot {snapshot.snapshot_id} was not made by this backend instance")
    sb = BwrapSandbox(self, snapshot.layers, config or self.config)
    with self._lock:
      self._sandboxes.add(sb)
    return sb

  def _check_open(self) -> None:
    if self._closed:
      raise SandboxClosedError("backend is closed")

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
      live = list(self._sandboxes)
    for sb in live:
      sb.close()
    self.store.remove()


class BwrapSandbox(Sandbox):
  """A fork: an overlay of the snapshot's layers under its own upper dir, plus its own cgroup."""

  def __init__(self, backend: BwrapBackend, layers: tuple[str, ...], config: SandboxConfig):
    super().__init__(config)
    self.backend = backend
    self.layers = layers
    self.dir = backend.store.new_sandbox_dir()
    self.upper, self.work, self.merged = (os.path.join(self.dir, x) for x in ("u", "w", "m"))
    self.cgroup = None
    try:
      for d in (self.upper, self.work, self.merged):
        os.makedirs(d)
      self._mount()
      if backend.cgroup_parents:
        name = os.path.basename(backend.store.path) + "-" + os.path.basename(self.dir)
        # Record the dirs before creating them, so a crash in between still leaves them findable by cleanup.
        backend.store.record_cgroups(
          sorted({os.path.join(p, "composer_sandboxes", name) for p in backend.cgroup_parents.values()}))
        self.cgroup = limits.SandboxCgroup(name, config.limits, backend.cgroup_parents)
    except BaseException:
      self._close()
      raise

  def _mount(self) -> None:
    overlay.mount(self.layers, self.merged, self.upper, self.work)

  def _root(self) -> str:
    return self.merged

  def run(self, cmd: str | Sequence[str], timeout: float = 60.0, stdin: bytes | None = None,
          env: Mapping[str, str] | None = None) -> RunResult:
    if not timeout > 0:
      raise ValueError(f"timeout must be positive, got {timeout!r}")
    argv = bwrap.build_argv(self.backend.bwrap, self.config, self.merged, self.backend._etc, cmd, env)
    with self._lock:
      self._check_open()
      cg = self.cgroup
      controllers = set(cg.dirs) if cg else set()
      preexec = limits.make_preexec(cg.procs_files() if cg else [], limits.rlimits_for(self.config.limits,
                                                                                          controllers))
      cpu_limit = self.config.limits.cpu_seconds
      poll = None
      if cg is not None:
        cg.start_run()
        if cpu_limit is not None and "cpuacct" in controllers:
          def poll():
            used = cg.run_cpu_seconds()
            return "cpu_time" if used is not None and used > cpu_limit else None

      def kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
          proc.send_signal(signal.SIGKILL)  # bwrap's death ends the pid namespace: the whole tree dies
        if cg is not None:
          cg.kill_all()

      t_start = time.time()
      out = run_process(argv, timeout=timeout, output_limit=self.config.output_limit_bytes, kill=kill, poll=poll,
                        stdin=stdin, preexec_fn=preexec, start_new_session=True)
      hit = cg.limit_hit() if cg is not None else None
      if hit is None:
        hit = _limit_from_exit(out.kill_reason, out.returncode)
      if hit is None and self.config.limits.file_size_bytes is not None:
        # SIGXFSZ may kill a child whose status the shell hides (`cmd > f; echo done`); a file left at exactly the
        # limit, written during this run, is the trace it leaves.
        if _file_at_size(self.upper, self.config.limits.file_size_bytes, t_start - 1):
          hit = "file_size"
      rc = out.returncode
      if rc == 1 and out.stderr.startswith(b"bwrap: execvp "):
        rc = 127  # bwrap's own report of a missing argv[0]; 127 is what a shell says
      return RunResult(exit_code=rc, stdout=out.stdout, stderr=out.stderr,
                       stdout_truncated=out.stdout_truncated, stderr_truncated=out.stderr_truncated,
                       wall_s=out.wall_s, timed_out=out.timed_out, limit_hit=hit)

  def snapshot(self) -> Snapshot:
    with self._lock:
      self._check_open()
      store = self.backend.store
      if os.listdir(self.upper):  # unchanged since the last snapshot/fork: reuse the same layers
        overlay.umount(self.merged)
        try:
          layer = store.new_layer_dir()
          os.rename(self.upper, layer)
          layers = (layer,) + self.layers
          if len(layers) > self.backend.max_layers or not overlay.fits(layers, self.upper, self.work):
            flat = store.new_layer_dir()
            overlay.flatten(layers, flat, scratch=os.path.join(self.dir, "f"))
            layers = (flat,)
          self.layers = layers
          overlay.remove_tree(self.work)  # holds a root-only "work" dir from the old mount
          os.makedirs(self.upper)
          os.makedirs(self.work)
        finally:
          self._mount()
      return Snapshot(self.backend.name, self.layers, os.path.basename(self.layers[0]))

  def _close(self) -> None:
    if self.cgroup is not None:
      self.cgroup.remove()
    overlay.remove_tree(self.dir)


def _file_at_size(root: str, size: int, since: float, max_entries: int = 20_000) -> bool:
  """Whether a regular file under `root` (the overlay upper: only what changed) has exactly `size` bytes."""
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
          if st.st_size == size and st.st_mtime >= since:
            return True
  return False


# 128+N is how bwrap (like a shell) reports a command killed by signal N.
_SIG_LIMITS = {128 + signal.SIGXCPU: "cpu_time", 128 + signal.SIGXFSZ: "file_size",
               -signal.SIGXCPU: "cpu_time", -signal.SIGXFSZ: "file_size"}


def _limit_from_exit(kill_reason: str | None, returncode: int | None) -> str | None:
  if kill_reason not in (None, "timeout"):
    return kill_reason
  return _SIG_LIMITS.get(returncode)

