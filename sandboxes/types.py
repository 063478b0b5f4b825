"""Plain data shared by every backend: limits, sandbox config, run results, snapshots and errors."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from sandboxes import checks

WORKSPACE = "/workspace"  # where the workspace appears inside a namespaced sandbox

MiB = 1 << 20


class SandboxError(RuntimeError):
  """Base class for errors raised by `sandboxes`."""


class BackendUnavailableError(SandboxError):
  """The requested backend cannot run on this machine (missing binary, no namespaces, not root, ...)."""


class SandboxClosedError(SandboxError):
  """An operation was attempted on a sandbox (or backend) that has been closed."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-sandbox resource limits; `None` means unlimited.

  Attributes:
    memory_bytes: resident memory of the whole sandbox (cgroup memory controller; RLIMIT_AS backstop only
      when no memory cgroup is available).
    max_pids: processes + threads alive at once (cgroup pids controller; RLIMIT_NPROC backstop, which the
      kernel ignores for uid 0).
    cpu_seconds: total CPU time of the whole sandbox per run (cgroup cpuacct usage, polled; RLIMIT_CPU
      per process as a backstop).
    cpus: CPU bandwidth in cores (cgroup cfs quota / cpu.max), e.g. 0.5.
    file_size_bytes: largest file any process may write (RLIMIT_FSIZE; cgroups have no such control).
    disk_bytes: total size of what the sandbox changed in its workspace (the snapshot it started from does not
      count). As root the fork's writable layer is its own tmpfs of this size, so a write beyond it fails with
      ENOSPC (`limit_hit="disk"`); being RAM, those files also count towards `memory_bytes`. Rootless, the
      changed files are polled every `disk_poll_s` and the command is killed when over.
    disk_inodes: how many files and directories the fork may add (the tmpfs's `nr_inodes`; `limit_hit="inodes"`).
    disk_poll_s: how often the rootless `disk_bytes` check walks the changed files.
    tmp_bytes: size of the private tmpfs at /tmp.
    open_files: RLIMIT_NOFILE.
    ptys: pseudo-terminals the sandbox may hold at once (the `max` of its own devpts instance; opening one more
      fails as "out of pty devices"). All sandboxes and containers on a host share one budget of ptys
      (`kernel.pty.max` - `kernel.pty.reserve`, 3,072 by default), so without a cap one fork could take them all.
      None: no cap of its own. Not enforced in rootless mode (bwrap makes the devpts instance there).
  """

  memory_bytes: int | None = 1024 * MiB
  max_pids: int | None = 256
  cpu_seconds: float | None = None
  cpus: float | None = None
  file_size_bytes: int | None = 256 * MiB
  disk_bytes: int | None = 4096 * MiB
  disk_inodes: int | None = 1 << 20
  disk_poll_s: float = 0.5
  tmp_bytes: int = 256 * MiB
  open_files: int = 1024
  ptys: int | None = 16

  def __post_init__(self):
    required = ("tmp_bytes", "open_files", "disk_poll_s")  # the rest may be None (unlimited)
    for name in ("memory_bytes", "max_pids", "file_size_bytes", "disk_bytes", "disk_inodes", "tmp_bytes",
                 "open_files", "ptys", "cpu_seconds", "cpus", "disk_poll_s"):
      v = getattr(self, name)
      if v is None and name not in required:
        continue
      whole = name not in ("cpu_seconds", "cpus", "disk_poll_s")  # counts and bytes: 1.5 pids means nothing
      kind = int if whole else int | float
      if isinstance(v, bool) or not isinstance(v, kind) or not v > 0 or not math.isfinite(v):
        want = "a positive integer" if whole else "a positive, finite number"
        raise ValueError(f"Limits.{name} must be {want}{'' if name in required else ' or None'}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """How a sandbox is set up; shared by all forks made with it.

  Attributes:
    limits: resource limits (per sandbox).
    ro_binds: extra host paths made visible read-only at the same path inside (e.g. a venv). The host
      Python's prefix (`sys.base_prefix`) is always added so `python3` works.
    env: extra environment variables (added over the defaults HOME, PATH, LANG, TMPDIR, WORKSPACE).
    path_prefix: directories put in front of the default PATH inside (e.g. a venv's `bin`).
    output_limit_bytes: stdout and stderr are each cut to this many bytes (head and tail kept).
    network: if True the sandbox keeps the host network (off by default; only for trusted commands).
  """

  limits: Limits = Limits()
  ro_binds: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()
  path_prefix: tuple[str, ...] = ()
  output_limit_bytes: int = 1 * MiB
  network: bool = False

  def __post_init__(self):
    if not isinstance(self.limits, Limits):
      raise TypeError(f"SandboxConfig.limits must be a Limits, got {type(self.limits).__name__}")
    checks.env_vars(dict(self.env), "SandboxConfig.env")
    for p in self.ro_binds + self.path_prefix:
      if not isinstance(p, str) or not os.path.isabs(p):
        raise ValueError(f"SandboxConfig paths must be absolute, got {p!r}")
    for p in self.ro_binds:
      if os.path.realpath(p) == "/":
        raise ValueError(f"SandboxConfig.ro_binds: {p!r} would show the whole host filesystem inside the sandbox")
    for p in self.ro_binds:
      if not os.path.exists(p):
        raise FileNotFoundError(f"SandboxConfig.ro_binds: host path {p!r} does not exist")
    if self.output_limit_bytes < 2:
      raise ValueError(f"output_limit_bytes must be >= 2, got {self.output_limit_bytes}")

  @staticmethod
  def make(env: Mapping[str, str] | None = None, **kw) -> SandboxConfig:
    """Like the constructor, but takes `env` as a dict."""
    return SandboxConfig(env=tuple(sorted((env or {}).items())), **kw)


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What one command did.

  Attributes:
    exit_code: the command's exit status as a shell reports it (128+N when killed by signal N); None when
      the sandbox itself was killed (timeout, CPU-time limit, or closed from another thread) before it exited.
    stdout, stderr: captured bytes, each at most `output_limit_bytes` (head and tail kept when cut).
    stdout_truncated, stderr_truncated: whether bytes were dropped.
    wall_s: wall-clock seconds from launch to exit.
    timed_out: the wall-clock timeout expired and the sandbox was killed.
    limit_hit: which limit stopped or constrained the command: "memory", "pids", "cpu_time", "file_size",
      "disk" (the fork's writable layer is full), "inodes" (it holds `disk_inodes` entries), or None.
  """

  exit_code: int | None
  stdout: bytes
  stderr: bytes
  stdout_truncated: bool
  stderr_truncated: bool
  wall_s: float
  timed_out: bool
  limit_hit: str | None = None

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out and self.limit_hit is None

  @property
  def stdout_text(self) -> str:
    return self.stdout.decode("utf-8", errors="replace")

  @property
  def stderr_text(self) -> str:
    return self.stderr.decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """An immutable filesystem state that any number of sandboxes can `fork` from.

  Attributes:
    backend: name of the backend that made it (a snapshot only forks on that backend's instance).
    layers: host directories, topmost first (overlay lower layers for bwrap; one full copy for local).
    snapshot_id: unique id.
  """

  backend: str
  layers: tuple[str, ...]
  snapshot_id: str
