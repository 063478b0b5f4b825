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
import warnings
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

  Commands run as an unprivileged host uid (`host_uid`, default 60000; uid 1000 inside), never as the caller's
  root: even a namespace escape lands as a nobody-like user. Workspace files belong to that uid on the host (the
  caller, as root, can still read, snapshot and delete them).

  Args:
    config: default `SandboxConfig` for forks.
    state_root: host dir for layers and workspaces (default /tmp/composer_sandboxes); stale state of dead
      owners in it is cleaned up on start.
    max_layers: a snapshot deeper than this is flattened into one layer (also done whenever the mount options
      would not fit the kernel's one-page limit). Deep stacks slow every lookup, so keep it well under 500.
    bwrap_path: explicit bwrap binary (else see `bwrap.find_bwrap`).
    host_uid, host_gid: the unprivileged host ids that sandboxed processes (and their files) have.
    launcher: how the bwrap process is put into its cgroups, rlimits and uid before it runs: "exec" (default; a
      `sh` -> `prlimit` -> `setpriv` exec chain, so the caller is vforked, cheap even from a process holding
      gigabytes) or "preexec" (a Python preexec_fn; a full fork, ~1 ms for a small caller, 100s of ms for a
      big one). "exec" falls back to "preexec" where util-linux's prlimit/setpriv are missing.
    cgroup_parents: controller ("memory", "pids", "cpu", "cpuacct") -> cgroup dir to create sandbox groups under,
      instead of the caller's own cgroups; e.g. a delegated, process-free cgroup on a cgroup v2 host. {} disables
      cgroups (rlimits only).
  """

  name = "bwrap"

  def __init__(self, config: SandboxConfig | None = None, state_root: str | None = None, max_layers: int = 32,
               bwrap_path: str | None = None, host_uid: int = 60000, host_gid: int = 60000,
               cgroup_parents: dict[str, str] | None = None, launcher: str = "exec"):
    if os.geteuid() != 0:
      raise BackendUnavailableError(
        "BwrapBackend needs root for overlay mounts and cgroups (rootless mode is not implemented); run as root, "
        "or explicitly choose the unsafe `UnsafeLocalBackend`.")
    if not 1 <= max_layers <= overlay.MAX_KERNEL_LAYERS:
      raise ValueError(f"{max_layers=} must be in [1, {overlay.MAX_KERNEL_LAYERS}]")
    self.bwrap = bwrap.find_bwrap(bwrap_path)
    self.config = config or SandboxConfig()
    self.max_layers = max_layers
    if host_uid <= 0 or host_gid <= 0:
      raise ValueError(f"host_uid/host_gid must be unprivileged (> 0), got {host_uid}/{host_gid}")
    self.owner = (host_uid, host_gid)
    if launcher not in ("exec", "preexec"):
      raise ValueError(f"unknown launcher {launcher!r}; valid: ['exec', 'preexec']")
    self.launcher = launcher
    self.cgroup_parents = limits.detect_parents() if cgroup_parents is None else dict(cgroup_parents)
    self._cgroups_explicit = cgroup_parents is not None
    self.store = Store(state_root)
    self._lock = threading.Lock()
    self._sandboxes: weakref.WeakSet[BwrapSandbox] = weakref.WeakSet()
    self._staged: dict[str, str] = {}
    self._snapshots: dict[str, tuple[str, ...]] = {}  # live snapshot id -> layers
    self._known_layers: set[str] = set()  # layers that _gc may delete once nothing uses them
    self._pending: list[tuple[str, ...]] = []  # layers of forks being mounted right now
    self._closed = False
    try:
      _check_traversable(self.store.path, *self.owner)
      self._etc = os.path.join(self.store.path, "etc")
      os.makedirs(self._etc, mode=0o755)
      for fname, text in bwrap.etc_files().items():
        with open(os.path.join(self._etc, fname), "w") as f:
          f.write(text)
        os.chmod(os.path.join(self._etc, fname), 0o644)
      self._self_test()
    except BaseException:
      self.close()
      raise

  def _self_test(self) -> None:
    """One `true` in an empty sandbox, so that a machine without user namespaces fails here, clearly; also the
    probe for usable cgroups."""
    empty = os.path.join(self.store.path, "empty")
    os.makedirs(empty)
    snap = self.import_dir(empty)
    cfg = SandboxConfig(limits=self.config.limits)
    try:
      try:
        sb = self.fork(snap, cfg)
      except limits.CgroupError as e:
        if self._cgroups_explicit:
          raise
        warnings.warn(f"sandbox cgroups are unusable here ({e}); limits fall back to rlimits (RLIMIT_AS, "
                      "RLIMIT_NPROC) and memory/pids hits are not reported", RuntimeWarning, stacklevel=3)
        self.cgroup_parents = {}
        sb = self.fork(snap, cfg)
      except OSError as e:
        raise BackendUnavailableError(
          f"cannot mount an overlay for a sandbox under {self.store.path}: {e}. The state_root must be on a "
          "filesystem that can hold overlayfs upper dirs (ext4, xfs, tmpfs; not overlayfs itself, as inside many "
          "containers): try state_root='/dev/shm/composer_sandboxes'.") from e
      with sb:
        r = sb.run(["true"], timeout=30)
    finally:
      self.delete_snapshot(snap)
      os.rmdir(empty)
    if r.exit_code != 0:
      raise BackendUnavailableError(
        f"bubblewrap cannot start a sandbox here (exit {r.exit_code}): {r.stderr_text.strip()} -- user namespaces "
        "may be disabled (sysctl user.max_user_namespaces / kernel.unprivileged_userns_clone).")

  def ro_binds(self, config: SandboxConfig) -> list[tuple[str, str]]:
    """(staged host source, path inside) for the host Python and `config.ro_binds`.

    Each host dir is bind-mounted read-only once under the store, so the unprivileged bwrap can reach it even
    below a root-only dir such as /root.
    """
    out = []
    for p in bwrap.python_prefixes() + tuple(config.ro_binds):
      real = os.path.realpath(p)
      with self._lock:
        self._check_open()
        if real not in self._staged:
          if os.path.isdir(real):
            staged = self.store.new_bind_dir()
            os.mkdir(staged)
          else:
            staged = self.store.new_bind_dir() + "f"
            open(staged, "w").close()
          overlay.bind_readonly(real, staged)
          self._staged[real] = staged
      out.append((self._staged[real], p))
    return out

  def import_dir(self, base_dir: str) -> Snapshot:
    if not isinstance(base_dir, str | os.PathLike) or not os.path.isdir(base_dir):
      raise FileNotFoundError(f"base directory {base_dir!r} does not exist or is not a directory")
    self._check_open()
    layer = self.store.new_layer_dir()
    try:
      overlay.copy_tree(os.fspath(base_dir), layer, owner=self.owner)
    except BaseException:
      overlay.remove_tree(layer)
      raise
    with self._lock:
      return self._register((layer,))

  def _register(self, layers: tuple[str, ...]) -> Snapshot:
    """A new live snapshot of `layers` (call with self._lock held)."""
    self._check_open()
    sid = "s" + self.store.new_id()
    self._snapshots[sid] = layers
    self._known_layers.update(layers)
    return Snapshot(self.name, layers, sid)

  def fork(self, snapshot: Snapshot, config: SandboxConfig | None = None) -> BwrapSandbox:
    with self._lock:
      self._check_open()
      if snapshot.backend != self.name or self._snapshots.get(snapshot.snapshot_id) != snapshot.layers:
        raise SandboxError(f"unknown snapshot {snapshot.snapshot_id}: deleted, or not made by this backend instance")
      self._pending.append(snapshot.layers)  # keeps _gc off these layers until the fork is registered
    try:
      sb = BwrapSandbox(self, snapshot.layers, config or self.config)
      with self._lock:
        self._sandboxes.add(sb)
    finally:
      with self._lock:
        self._pending.remove(snapshot.layers)
    return sb

  def delete_snapshot(self, snapshot: Snapshot) -> None:
    """Forgets a snapshot and deletes its layers unless another snapshot or a live fork still uses them."""
    with self._lock:
      if self._snapshots.pop(snapshot.snapshot_id, None) is None:
        raise SandboxError(f"unknown snapshot {snapshot.snapshot_id}: already deleted, or not made by this backend")
    self._gc()

  def _gc(self) -> None:
    """Deletes layers that no live snapshot, fork or fork-in-progress uses."""
    with self._lock:
      if self._closed:
        return  # close() deletes the whole store
      used = set().union(*self._snapshots.values(), *self._pending,
                         *(sb.layers for sb in self._sandboxes if not sb.closed))
      dead = self._known_layers - used
      self._known_layers -= dead
    for layer in dead:
      overlay.remove_tree(layer)

  @property
  def live_layers(self) -> int:
    """How many layer directories exist (for tests and monitoring)."""
    return len(os.listdir(os.path.join(self.store.path, "l")))

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
    self._closing = False
    self._owner = backend.owner
    try:
      for d in (self.upper, self.work, self.merged):
        os.makedirs(d)
      os.chown(self.upper, *self._owner)  # the workspace root (the overlay's root takes the upper's owner)
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

  def close(self) -> None:
    """Like `Sandbox.close`, but a command running in another thread is killed first instead of awaited."""
    self._closing = True  # seen by the running command's poll within 50 ms
    super().close()

  def _mount(self) -> None:
    overlay.mount(self.layers, self.merged, self.upper, self.work)

  def _root(self) -> str:
    return self.merged

  def run(self, cmd: str | Sequence[str], timeout: float = 60.0, stdin: bytes | None = None,
          env: Mapping[str, str] | None = None) -> RunResult:
    if not timeout > 0:
      raise ValueError(f"timeout must be positive, got {timeout!r}")
    argv = bwrap.build_argv(self.backend.bwrap, self.config, self.merged, self.backend._etc, cmd, env,
                            self.backend.ro_binds(self.config))
    with self._lock:
      self._check_open()
      cg = self.cgroup
      controllers = set(cg.dirs) if cg else set()
      rlimits = limits.rlimits_for(self.config.limits, controllers)
      procs = cg.procs_files() if cg else []
      launcher = limits.launcher_argv(procs, rlimits, *self._owner) if self.backend.launcher == "exec" else None
      if launcher is not None:
        argv, popen_kw = launcher + argv, {}
      else:
        popen_kw = {"preexec_fn": limits.make_preexec(procs, rlimits, *self._owner)}
      cpu_limit = self.config.limits.cpu_seconds if cg is not None and "cpuacct" in controllers else None
      if cg is not None:
        cg.start_run()

      disk_limit = self.config.limits.disk_bytes
      next_disk_check = [time.monotonic() + self.config.limits.disk_poll_s]

      def poll() -> str | None:
        if self._closing:
          return "closed"
        if cpu_limit is not None:
          used = cg.run_cpu_seconds()
          if used is not None and used > cpu_limit:
            return "cpu_time"
        if disk_limit is not None and time.monotonic() >= next_disk_check[0]:
          next_disk_check[0] = time.monotonic() + self.config.limits.disk_poll_s
          if _tree_bytes(self.upper, stop_above=disk_limit) > disk_limit:
            return "disk"
        return None

      def kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
          proc.send_signal(signal.SIGKILL)  # bwrap's death ends the pid namespace: the whole tree dies
        if cg is not None:
          cg.kill_all()

      t_start = time.time()
      out = run_process(argv, timeout=timeout, output_limit=self.config.output_limit_bytes, kill=kill, poll=poll,
                        stdin=stdin, start_new_session=True, **popen_kw)
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
      if not os.listdir(self.upper):  # unchanged since the last snapshot/fork: the same layers, a new id
        with self.backend._lock:
          return self.backend._register(self.layers)
      overlay.umount(self.merged)
      try:
        layer = store.new_layer_dir()
        os.rename(self.upper, layer)
        self.layers = (layer,) + self.layers  # from here on the fork's state lives in `layer`
        with self.backend._lock:
          self.backend._known_layers.add(layer)
        if len(self.layers) > self.backend.max_layers or not overlay.fits(self.layers, self.upper, self.work):
          flat = store.new_layer_dir()
          overlay.flatten(self.layers, flat, scratch=os.path.join(self.dir, "f"))
          with self.backend._lock:
            self.backend._known_layers.add(flat)
          self.layers = (flat,)
        overlay.remove_tree(self.work)  # holds a root-only "work" dir from the old mount
      finally:
        if not os.path.isdir(self.upper):
          os.makedirs(self.upper)
          os.chown(self.upper, *self._owner)
        os.makedirs(self.work, exist_ok=True)
        self._mount()
      with self.backend._lock:
        snap = self.backend._register(self.layers)
    self.backend._gc()  # e.g. the layers a flatten replaced
    return snap

  def _close(self) -> None:
    if self.cgroup is not None:
      self.cgroup.remove()
    overlay.remove_tree(self.dir)
    self.backend._gc()  # layers only this fork still used (its snapshot was deleted while it lived)


def _check_traversable(path: str, uid: int, gid: int) -> None:
  """Raises if `uid` cannot reach `path` (e.g. a state_root under a 0700 pytest tmp dir)."""
  p = os.path.abspath(path)
  while True:
    st = os.stat(p)
    bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
    if not st.st_mode & bit:
      raise SandboxError(f"the sandbox uid {uid} cannot enter {p} (mode {oct(st.st_mode & 0o777)}), on the way to "
                         f"{path}; choose a state_root whose parents are world-executable (e.g. under /tmp)")
    if p == "/":
      return
    p = os.path.dirname(p)


def _tree_bytes(root: str, stop_above: int) -> int:
  """Disk usage (allocated blocks) of a tree; stops counting once above `stop_above`."""
  total = 0
  stack = [root]
  while stack and total <= stop_above:
    try:
      it = os.scandir(stack.pop())
    except OSError:
      continue
    with it:
      for e in it:
        try:
          st = e.stat(follow_symlinks=False)
        except OSError:
          continue
        total += st.st_blocks * 512
        if e.is_dir(follow_symlinks=False):
          stack.append(e.path)
  return total


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
  if kill_reason not in (None, "timeout", "closed"):
    return kill_reason
  return _SIG_LIMITS.get(returncode)

