"""The default backend: bubblewrap (Linux namespaces) + overlayfs snapshots/forks + cgroup limits.

Each `run` starts a fresh bwrap: new user/pid/ipc/uts/net/mount/cgroup namespaces, unprivileged uid 1000 inside
with every capability dropped and nested user namespaces disabled, read-only system dirs, a private tmpfs /tmp,
and the fork's overlay mount bound read-write at /workspace. The bwrap process is placed in the sandbox's cgroups
before it execs, so every descendant is counted and limited; when the command exits (or is killed, or the caller
dies) the pid namespace ends and takes every process with it. (Rootless callers get the same, except that bwrap
mounts the overlay itself; see `BwrapBackend`.)
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence

from sandboxes import bwrap, fsops, limits, overlay, scan
from sandboxes.process import run_process
from sandboxes.sandbox import Backend, Sandbox
from sandboxes.store import Store, check_traversable
from sandboxes.types import (
  WORKSPACE,
  BackendUnavailableError,
  RunResult,
  SandboxClosedError,
  SandboxConfig,
  SandboxError,
  Snapshot,
)


class BwrapBackend(Backend):
  """Namespaced sandboxes with overlayfs forks (bubblewrap >= 0.10).

  As root: overlays are mounted on the host and commands run as an unprivileged host uid (`host_uid`, default
  60000; uid 1000 inside), never as the caller's root: even a namespace escape lands as a nobody-like user.
  Workspace files belong to that uid on the host (the caller, as root, can still read, snapshot and delete them).
  Not as root (rootless): bwrap runs as the caller and mounts each overlay inside the sandbox; file calls go
  through commands in the sandbox; limits are rlimits unless a writable cgroup is given (see README).

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
    # Rootless: bwrap mounts the overlay itself, inside the sandbox; the sandbox runs as the caller's uid; file
    # calls go through commands in the sandbox; limits are rlimits unless a writable cgroup is given.
    self.rootless = os.geteuid() != 0
    if not 1 <= max_layers <= overlay.MAX_KERNEL_LAYERS:
      raise ValueError(f"{max_layers=} must be in [1, {overlay.MAX_KERNEL_LAYERS}]")
    self.bwrap = bwrap.find_bwrap(bwrap_path)
    self.config = config or SandboxConfig()
    self.max_layers = max_layers
    if self.rootless:
      host_uid, host_gid = os.getuid(), os.getgid()
    elif host_uid <= 0 or host_gid <= 0:
      raise ValueError(f"host_uid/host_gid must be unprivileged (> 0), got {host_uid}/{host_gid}")
    self.owner = (host_uid, host_gid)
    self._switch_uid = None if self.rootless else self.owner  # (uid, gid) the launcher drops to
    if launcher not in ("exec", "preexec"):
      raise ValueError(f"unknown launcher {launcher!r}; valid: ['exec', 'preexec']")
    self.launcher = launcher
    self.cgroup_parents = limits.detect_parents() if cgroup_parents is None else dict(cgroup_parents)
    self._cgroups_explicit = cgroup_parents is not None
    if self.rootless and not self.cgroup_parents:
      warnings.warn("rootless BwrapBackend without a writable (delegated) cgroup: memory is limited by RLIMIT_AS "
                    "and processes by RLIMIT_NPROC over all of this user's processes; memory/pids/disk-in-cgroup "
                    "hits are not reported as such", RuntimeWarning, stacklevel=2)
    self.store = Store(state_root)
    self._lock = threading.Lock()
    self._sandboxes: weakref.WeakSet[BwrapSandbox] = weakref.WeakSet()
    self._staged: dict[str, str] = {}
    self._snapshots: dict[str, tuple[str, ...]] = {}  # live snapshot id -> layers
    self._known_layers: set[str] = set()  # layers that _gc may delete once nothing uses them
    self._pending: list[tuple[str, ...]] = []  # layers of forks being mounted right now
    self._closed = False
    try:
      check_traversable(self.store.path, *self.owner)
      if not self.rootless:
        self.bwrap = self._reachable_bwrap(self.bwrap)
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

  def _reachable_bwrap(self, path: str) -> str:
    """`path`, or a copy in the store if the sandbox uid cannot reach it (e.g. a venv below root-only /root)."""
    try:
      check_traversable(os.path.dirname(path), *self.owner)
      if os.stat(path).st_mode & 0o001:
        return path
    except SandboxError:
      pass
    bin_dir = os.path.dirname(path)
    dst_root = os.path.join(self.store.path, "bwrap")
    if os.path.basename(bin_dir) == "_bin":  # the wheel: keep the layout its RPATH ($ORIGIN/../../X.libs) expects
      pkg = os.path.dirname(bin_dir)
      shutil.copytree(pkg, os.path.join(dst_root, os.path.basename(pkg)))
      libs = pkg + ".libs"
      if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(dst_root, os.path.basename(libs)))
      staged = os.path.join(dst_root, os.path.basename(pkg), "_bin", os.path.basename(path))
    else:
      os.makedirs(dst_root)
      staged = os.path.join(dst_root, "bwrap")
      shutil.copy2(path, staged)
    subprocess.run(["chmod", "-R", "a+rX", dst_root], check=True)
    return staged

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
      if self.rootless:  # nothing to stage (and no right to mount): what the caller reaches, bwrap reaches
        out.append((real, p))
        continue
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
    self._at_limit: set[tuple[str, int]] = set()  # files at file_size_bytes after the last run
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
    if not self.backend.rootless:  # rootless: bwrap mounts the overlay inside each sandbox instead
      overlay.mount(self.layers, self.merged, self.upper, self.work)

  def _root(self) -> str:
    return self.merged

  def run(self, cmd: str | Sequence[str], timeout: float = 60.0, stdin: bytes | None = None,
          env: Mapping[str, str] | None = None) -> RunResult:
    return self._run(cmd, timeout, stdin, env)

  def _run(self, cmd: str | Sequence[str], timeout: float = 60.0, stdin: bytes | None = None,
           env: Mapping[str, str] | None = None, output_limit: int | None = None,
           workspace: tuple[tuple[str, ...], str | None, str | None] | None = None,
           rw_binds: Sequence[tuple[str, str]] = ()) -> RunResult:
    """`run` with internal options: a bigger output cap (file reads), another workspace or extra binds (flatten)."""
    if not timeout > 0:
      raise ValueError(f"timeout must be positive, got {timeout!r}")
    with self._lock:
      self._check_open()
      if workspace is None:
        workspace = (self.layers, self.upper, self.work) if self.backend.rootless else self.merged
      argv = bwrap.build_argv(self.backend.bwrap, self.config, workspace, self.backend._etc, cmd, env,
                              self.backend.ro_binds(self.config), rw_binds)
      cg = self.cgroup
      controllers = set(cg.dirs) if cg else set()
      nproc_base = 0
      if self.backend.rootless and "pids" not in controllers and self.config.limits.max_pids is not None:
        nproc_base = limits.processes_of(os.getuid())
      rlimits = limits.rlimits_for(self.config.limits, controllers, nproc_base)
      procs = cg.procs_files() if cg else []
      uid_gid = self.backend._switch_uid or (None, None)
      launcher = limits.launcher_argv(procs, rlimits, *uid_gid) if self.backend.launcher == "exec" else None
      if launcher is not None:
        argv, popen_kw = launcher + argv, {}
      else:
        popen_kw = {"preexec_fn": limits.make_preexec(procs, rlimits, *uid_gid)}
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
          if scan.tree_bytes(self.upper, stop_above=disk_limit) > disk_limit:
            return "disk"
        return None

      def kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
          proc.send_signal(signal.SIGKILL)  # bwrap's death ends the pid namespace: the whole tree dies
        if cg is not None:
          cg.kill_all()

      out = run_process(argv, timeout=timeout, output_limit=output_limit or self.config.output_limit_bytes, kill=kill,
                        poll=poll, stdin=stdin, start_new_session=True, **popen_kw)
      hit = cg.limit_hit() if cg is not None else None
      if hit is None:
        hit = _limit_from_exit(out.kill_reason, out.returncode)
      if self.config.limits.file_size_bytes is not None:
        # SIGXFSZ may kill a child whose status the shell hides (`cmd > f; echo done`); a file at exactly the
        # limit that was not there (with that mtime) after the previous run is the trace it leaves.
        at_limit = scan.files_at_size(self.upper, self.config.limits.file_size_bytes)
        if hit is None and at_limit - self._at_limit:
          hit = "file_size"
        self._at_limit = at_limit
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
      if not self.backend.rootless:
        overlay.umount(self.merged)
      try:
        layer = store.new_layer_dir()
        os.rename(self.upper, layer)
        self.layers = (layer,) + self.layers  # from here on the fork's state lives in `layer`
        with self.backend._lock:
          self.backend._known_layers.add(layer)
        if len(self.layers) > self.backend.max_layers or not overlay.fits(self.layers, self.upper, self.work):
          flat = store.new_layer_dir()
          if self.backend.rootless:
            self._flatten_inside(flat)
          else:
            overlay.flatten(self.layers, flat, scratch=os.path.join(self.dir, "f"))
          with self.backend._lock:
            self.backend._known_layers.add(flat)
          self.layers = (flat,)
        overlay.remove_tree(self.work)  # holds a root-only "work" dir from the old mount
      finally:
        if not os.path.isdir(self.upper):
          os.makedirs(self.upper)
          os.chown(self.upper, *self._owner)
        self._at_limit = set()  # those files moved into a layer with the upper dir
        os.makedirs(self.work, exist_ok=True)
        self._mount()
      with self.backend._lock:
        snap = self.backend._register(self.layers)
    self.backend._gc()  # e.g. the layers a flatten replaced
    return snap

  def _flatten_inside(self, flat: str) -> None:
    """Rootless flatten: copy a read-only overlay of the layers into `flat` from inside a sandbox."""
    os.makedirs(flat)
    r = self._run(["cp", "-a", WORKSPACE + "/.", "/flat/"], timeout=3600, workspace=(self.layers, None, None),
                  rw_binds=[(flat, "/flat")])
    if not r.ok:
      raise SandboxError(f"flattening {len(self.layers)} layers failed: {r.stderr_text.strip()}")

  # -- rootless file access: there is no merged view on the host, so it goes through commands in the sandbox --
  def _file_cmd(self, argv: list[str], path: str, stdin: bytes | None = None,
                output_limit: int | None = None) -> RunResult:
    r = self._run(argv, timeout=600, stdin=stdin, output_limit=output_limit)
    if r.exit_code != 0:
      err = r.stderr_text.strip()
      if "No such file" in err:
        raise FileNotFoundError(errno.ENOENT, f"{err}", path)
      if "Is a directory" in err:
        raise IsADirectoryError(errno.EISDIR, f"{err}", path)
      raise OSError(f"{argv[0]} {path!r} in the sandbox failed (exit {r.exit_code}): {err}")
    return r

  def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
    if not self.backend.rootless:
      return super().read_file(path, max_bytes)
    p = _inside(path)
    if max_bytes is None:  # stat first: the output cap must fit the whole file
      size = int(self._file_cmd(["stat", "-L", "-c", "%s", "--", p], path).stdout)
      return self._file_cmd(["cat", "--", p], path, output_limit=max(2, size + 1)).stdout
    return self._file_cmd(["head", "-c", str(max_bytes), "--", p], path, output_limit=max(2, max_bytes)).stdout

  def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
    if not self.backend.rootless:
      return super().write_file(path, data, mode)
    script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" "$1"'
    data = data.encode() if isinstance(data, str) else data
    self._file_cmd(["sh", "-c", script, "sh", _inside(path), f"{mode:o}"], path, stdin=data)

  def list_dir(self, path: str = ".") -> list[str]:
    if not self.backend.rootless:
      return super().list_dir(path)
    out = self._file_cmd(["find", _inside(path), "-mindepth", "1", "-maxdepth", "1", "-printf", "%f\\0"], path,
                         output_limit=1 << 30).stdout
    return sorted(n.decode("utf-8", "surrogateescape") for n in out.split(b"\0") if n)

  def remove(self, path: str) -> None:
    if not self.backend.rootless:
      return super().remove(path)
    p = _inside(path)
    if os.path.normpath(p) == WORKSPACE:
      raise SandboxError("refusing to remove the workspace root")
    if not self.exists(path):
      raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    self._file_cmd(["rm", "-rf", "--", p], path)

  def exists(self, path: str) -> bool:
    if not self.backend.rootless:
      return super().exists(path)
    p = _inside(path)
    return self._run(["sh", "-c", 'test -e "$1" || test -L "$1"', "sh", p], timeout=60).exit_code == 0

  def _close(self) -> None:
    if self.cgroup is not None:
      self.cgroup.remove()
    overlay.remove_tree(self.dir)
    self.backend._gc()  # layers only this fork still used (its snapshot was deleted while it lived)


def _inside(path: str) -> str:
  """The absolute in-sandbox path of a workspace path (validated like the host-side calls)."""
  return os.path.normpath(os.path.join(WORKSPACE, fsops.to_relative(path)))


# 128+N is how bwrap (like a shell) reports a command killed by signal N.
_SIG_LIMITS = {128 + signal.SIGXCPU: "cpu_time", 128 + signal.SIGXFSZ: "file_size",
               -signal.SIGXCPU: "cpu_time", -signal.SIGXFSZ: "file_size"}


def _limit_from_exit(kill_reason: str | None, returncode: int | None) -> str | None:
  if kill_reason not in (None, "timeout", "closed"):
    return kill_reason
  return _SIG_LIMITS.get(returncode)

