"""A fork of the bubblewrap backend (`bwrap_backend.py`): an overlay of a snapshot's layers, its own cgroup, and a
fresh bwrap per `run` (the backend's docstring says what each run gets). Rootless forks subclass it (`rootless.py`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess

from sandboxes import bwrap, checks, limits, overlay, scan
from sandboxes.process import run_process
from sandboxes.sandbox import Backend, Sandbox, result_from
from sandboxes.types import RunResult, SandboxConfig, Snapshot

BWRAP_MAX_ARGS = 9000  # bwrap refuses longer command lines
# The launcher chain (setpriv, sh, prlimit, bwrap) needs no environment: every program is named by absolute path
# and bwrap builds the command's environment itself (--clearenv/--setenv). Anything passed here would stay
# readable inside, in /proc/1/environ (bwrap is the sandbox's pid 1).
LAUNCH_ENV: dict[str, str] = {}


class BwrapSandbox(Sandbox):
  """A fork: an overlay of the snapshot's layers under its own upper dir (on its own tmpfs), plus its own cgroup.

  Layout under the fork's dir: `t/` the tmpfs holding `u/` (upper) and `w/` (overlay work dir); `m/` the merged
  mount that is bound at /workspace; `p/` its devpts instance (`Limits.ptys`), bound at /dev/pts.
  """

  def __init__(self, backend: Backend, layers: tuple[str, ...], config: SandboxConfig):
    super().__init__(config)
    self.backend = backend
    self.layers = layers
    self.dir = backend.store.new_sandbox_dir()
    self.tmpfs, self.merged = os.path.join(self.dir, "t"), os.path.join(self.dir, "m")
    self.upper, self.work = os.path.join(self.tmpfs, "u"), os.path.join(self.tmpfs, "w")
    self.cgroup = None
    self.devpts = None
    self._at_limit: set[tuple[str, int]] = set()  # files at file_size_bytes after the last run
    self._owner = backend.owner
    try:
      os.makedirs(self.tmpfs)
      os.makedirs(self.merged)
      self._mount()
      if config.limits.ptys is not None and not backend.rootless:
        self.devpts = os.path.join(self.dir, "p")
        os.makedirs(self.devpts)
        overlay.mount_devpts(self.devpts, config.limits.ptys)
      if backend.cgroup_parents:
        name = os.path.basename(backend.store.path) + "-" + os.path.basename(self.dir)
        # Record the dirs before creating them, so a crash in between still leaves them findable by cleanup.
        backend.store.record_cgroups(
          sorted({os.path.join(p, "composer_sandboxes", name) for p in backend.cgroup_parents.values()}))
        self.cgroup = limits.SandboxCgroup(name, config.limits, backend.cgroup_parents)
    except BaseException:
      self._close()
      raise

  # -- the writable layer ----------------------------------------------------------------------------------
  def _new_upper(self) -> None:
    """A fresh, empty tmpfs for the upper and work dirs (the few inodes of our own dirs come on top)."""
    lim = self.config.limits
    overlay.mount_tmpfs(self.tmpfs, lim.disk_bytes, lim.disk_inodes and lim.disk_inodes + 4, mode=0o711)
    os.makedirs(self.upper)
    os.makedirs(self.work)
    os.chown(self.upper, *self._owner)  # the workspace root (the overlay's root takes the upper's owner)

  def _mount(self) -> None:
    self._new_upper()
    overlay.mount(self.layers, self.merged, self.upper, self.work)

  def _layer_full(self) -> str | None:
    """"disk" / "inodes" when the writable layer has no room left (the kernel refused, or would refuse, writes)."""
    st = os.statvfs(self.tmpfs)
    if self.config.limits.disk_bytes is not None and st.f_bavail == 0:
      return "disk"
    if self.config.limits.disk_inodes is not None and st.f_favail == 0:
      return "inodes"
    return None

  def _root(self) -> str:
    return self.merged

  # -- commands --------------------------------------------------------------------------------------------
  def _run(self, argv: list[str], timeout: float, stdin: bytes | None, env: dict[str, str]) -> RunResult:
    return self._launch(argv, timeout, stdin, env)

  def _workspace(self):
    """What bwrap binds at /workspace: the merged overlay mount."""
    return self.merged

  def _launch(self, argv: list[str], timeout: float, stdin: bytes | None, env: dict[str, str],
              output_limit: int | None = None, workspace=None, rw_binds=()) -> RunResult:
    """One bwrap run (lock held). Internal options: a bigger output cap (file reads), another workspace or extra
    binds (flattening)."""
    be, lim = self.backend, self.config.limits
    fd = os.open(be._seccomp, os.O_RDONLY | os.O_CLOEXEC) if be._seccomp else None
    try:
      full = bwrap.build_argv(be.bwrap, self.config, workspace or self._workspace(), be._etc, argv, env,
                              be.ro_binds(self.config), rw_binds, seccomp_fd=fd, devpts=self.devpts)
      checks.total_size(full, BWRAP_MAX_ARGS)
      full, popen_kw = self._launcher(full)
      checks.total_size(full)
      cg = self.cgroup
      cpu_limit = lim.cpu_seconds if cg is not None and "cpuacct" in cg.dirs else None
      if cg is not None:
        cg.start_run()
      full_seen = [None]  # the writable layer filling up during the run (a command may delete files after)

      def poll() -> str | None:
        if cpu_limit is not None:
          used = cg.run_cpu_seconds()
          if used is not None and used > cpu_limit:
            return "cpu_time"
        full_seen[0] = full_seen[0] or self._layer_full()
        return self._poll_disk() or self._poll_closed()

      def kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
          proc.send_signal(signal.SIGKILL)  # bwrap's death ends the pid namespace: the whole tree dies
        if cg is not None:
          cg.kill_all()

      out = run_process(full, timeout=timeout, output_limit=output_limit or self.config.output_limit_bytes,
                        kill=kill, poll=poll, stdin=stdin, start_new_session=True, env=LAUNCH_ENV,
                        pass_fds=() if fd is None else (fd,), **popen_kw)
    finally:
      if fd is not None:
        os.close(fd)
    at_file_limit = self._file_size_hit()  # always: it also records this run's files for the next one
    hit = (cg.limit_hit() if cg is not None else None) or self._layer_full() or full_seen[0] or at_file_limit
    if out.returncode == 1 and out.stderr.startswith(b"bwrap: execvp "):
      out = dataclasses.replace(out, returncode=127)  # bwrap's report of a missing argv[0]; a shell says 127
    return result_from(out, hit)

  def _launcher(self, argv: list[str]) -> tuple[list[str], dict]:
    """The command line (and Popen options) that puts bwrap into the cgroups, rlimits and uid of the sandbox."""
    cg, lim = self.cgroup, self.config.limits
    controllers = set(cg.dirs) if cg else set()
    nproc_base = 0
    if self.backend.rootless and "pids" not in controllers and lim.max_pids is not None:
      nproc_base = limits.processes_of(os.getuid())
    rlimits = limits.rlimits_for(lim, controllers, nproc_base)
    procs = cg.procs_files() if cg else []
    uid_gid = self.backend._switch_uid or (None, None)
    launcher = limits.launcher_argv(procs, rlimits, *uid_gid) if self.backend.launcher == "exec" else None
    if launcher is not None:
      return launcher + argv, {}
    return argv, {"preexec_fn": limits.make_preexec(procs, rlimits, *uid_gid)}

  def _poll_disk(self) -> str | None:
    """As root the kernel bounds the writable layer; nothing to poll (rootless overrides this)."""
    return None

  def _file_size_hit(self) -> str | None:
    """SIGXFSZ may kill a child whose status the shell hides (`cmd > f; echo done`); a file at exactly the
    limit that was not there (with that mtime) after the previous run is the trace it leaves."""
    if self.config.limits.file_size_bytes is None:
      return None
    at_limit = scan.files_at_size(self.upper, self.config.limits.file_size_bytes)
    new, self._at_limit = at_limit - self._at_limit, at_limit
    return "file_size" if new else None

  # -- snapshots -------------------------------------------------------------------------------------------
  def snapshot(self) -> Snapshot:
    with self._lock:
      self._check_open()
      be = self.backend
      if not os.listdir(self.upper):  # unchanged since the last snapshot/fork: the same layers, a new id
        with be._lock:
          return be._register(self.layers)
      layer = be.store.new_layer_dir()
      self._freeze_upper(layer)
      scan.drop_setid_bits(layer)
      self.layers = (layer,) + self.layers  # from here on the fork's state lives in `layer`
      self._at_limit = set()  # those files moved into a layer with the upper dir
      with be._lock:
        be._known_layers.add(layer)
      if len(self.layers) > be.max_layers or not overlay.fits(self.layers, self.upper, self.work):
        flat = be.store.new_layer_dir()
        self._flatten(flat)
        with be._lock:
          be._known_layers.add(flat)
        self.layers = (flat,)
      self._remount()
      with be._lock:
        snap = be._register(self.layers)
    be._gc()  # e.g. the layers a flatten replaced
    return snap

  def _freeze_upper(self, layer: str) -> None:
    """Copies the (idle) fork's upper dir into the new layer `layer` and empties the fork's tmpfs.

    A copy, not a rename: the upper lives on the fork's tmpfs. If the copy fails the fork is left as it was.
    """
    overlay.umount(self.merged)
    try:
      overlay.copy_tree(self.upper, layer, preserve_owner=True)
    except BaseException:
      overlay.remove_tree(layer)
      overlay.mount(self.layers, self.merged, self.upper, self.work)
      raise
    overlay.umount(self.tmpfs)

  def _flatten(self, flat: str) -> None:
    overlay.flatten(self.layers, flat, scratch=os.path.join(self.dir, "f"))

  def _remount(self) -> None:
    self._mount()

  def _close(self) -> None:
    if self.cgroup is not None:
      self.cgroup.kill_all()  # nothing may hold the mounts open
    try:
      overlay.remove_tree(self.dir)  # unmounts the overlay and the tmpfs: the fork's files go at once
    finally:
      if self.cgroup is not None:
        self.cgroup.remove()
      self.backend._gc()  # layers only this fork still used (its snapshot was deleted while it lived)
