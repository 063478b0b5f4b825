"""The default backend: bubblewrap (Linux namespaces) + overlayfs snapshots/forks + cgroup limits + seccomp.

Each `run` starts a fresh bwrap: new user/pid/ipc/uts/net/mount/cgroup namespaces, unprivileged uid 1000 inside
with every capability dropped and nested user namespaces disabled, a syscall filter, read-only system dirs, a
private tmpfs /tmp, and the fork's overlay mount bound read-write at /workspace. The bwrap process is placed in
the sandbox's cgroups before it execs, so every descendant is counted and limited; when the command exits (or is
killed, or the caller dies) the pid namespace ends and takes every process with it. The fork's writable layer
(the overlay's upper dir) is a tmpfs of `Limits.disk_bytes` / `disk_inodes`, so the kernel bounds it. (Rootless
callers get the same, except that bwrap mounts the overlay itself; see `rootless.py`.)
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import warnings

from sandboxes import bwrap, limits, overlay
from sandboxes import seccomp as syscall_filter
from sandboxes.namespaced import BwrapSandbox
from sandboxes.rootless import RootlessSandbox
from sandboxes.sandbox import Backend
from sandboxes.store import Store, check_traversable
from sandboxes.types import BackendUnavailableError, SandboxConfig, SandboxError, Snapshot


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
    seccomp: install the syscall filter of `seccomp.py` in every sandbox (needs libseccomp); False only for
      hosts without it, and knowingly.
  """

  name = "bwrap"

  def __init__(self, config: SandboxConfig | None = None, state_root: str | None = None, max_layers: int = 32,
               bwrap_path: str | None = None, host_uid: int = 60000, host_gid: int = 60000,
               cgroup_parents: dict[str, str] | None = None, launcher: str = "exec", seccomp: bool = True):
    super().__init__(config)
    self.rootless = os.geteuid() != 0
    if not 1 <= max_layers <= overlay.MAX_KERNEL_LAYERS:
      raise ValueError(f"{max_layers=} must be in [1, {overlay.MAX_KERNEL_LAYERS}]")
    self.bwrap = bwrap.find_bwrap(bwrap_path)
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
    # Closed to other host users (the sandbox's group may enter: bwrap runs as it and binds from the store).
    self.store = Store(state_root, group=None if self.rootless else host_gid)
    self._staged: dict[str, str] = {}
    self._snapshots: dict[str, tuple[str, ...]] = {}  # live snapshot id -> layers
    self._known_layers: set[str] = set()  # layers that _gc may delete once nothing uses them
    self._pending: list[tuple[str, ...]] = []  # layers of forks being mounted right now
    try:
      check_traversable(self.store.path, *self.owner)
      if not self.rootless:
        self.bwrap = self._reachable_bwrap(self.bwrap)
      self._etc = os.path.join(self.store.path, "etc")
      bwrap.stage_etc(self._etc)
      if not self.rootless:
        self._check_layer_fs()
      self._seccomp = os.path.join(self.store.path, "seccomp.bpf") if seccomp else None
      if self._seccomp:
        syscall_filter.build(self._seccomp)
      self._self_test()
    except BaseException:
      self.close()
      self.store.remove_state_root_if_made()
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

  def _check_layer_fs(self) -> None:
    """Snapshots copy a fork's upper dir into the store; its whiteouts are 0:0 character devices, which some
    filesystems (overlayfs itself, as inside many containers) refuse."""
    probe = os.path.join(self.store.path, "whiteout-probe")
    try:
      os.mknod(probe, 0o600 | stat.S_IFCHR, os.makedev(0, 0))
      os.unlink(probe)
    except OSError as e:
      raise BackendUnavailableError(
        f"the state_root {self.store.state_root} cannot hold overlay layers ({e}: no whiteout files). The "
        "state_root must be on a filesystem such as ext4, xfs or tmpfs, not overlayfs itself (as inside many "
        "containers): try state_root='/dev/shm/composer_sandboxes'.") from e

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
          "filesystem that can hold overlayfs lower dirs (ext4, xfs, tmpfs; not overlayfs itself, as inside many "
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
    state = self.store.state_root + "/"
    for p in bwrap.python_prefixes() + tuple(config.ro_binds):
      real = os.path.realpath(p)
      if state.startswith(real.rstrip("/") + "/"):
        raise ValueError(f"SandboxConfig.ro_binds: {p!r} contains the sandbox state root {self.store.state_root} "
                         "(every sandbox's workspace would be visible)")
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
      if not isinstance(snapshot, Snapshot) or snapshot.backend != self.name \
         or self._snapshots.get(snapshot.snapshot_id) != snapshot.layers:
        raise SandboxError(f"unknown snapshot {snapshot!r}: deleted, or not made by this backend instance")
      self._pending.append(snapshot.layers)  # keeps _gc off these layers until the fork is registered
    try:
      self.ro_binds(config or self.config)  # refuses bad binds now, not at the first run; stages the rest
      if self.rootless:
        sb = RootlessSandbox(self, snapshot.layers, config or self.config)
      else:
        sb = BwrapSandbox(self, snapshot.layers, config or self.config)
      self._track(sb)
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

  def _close(self) -> None:
    self.store.remove()
