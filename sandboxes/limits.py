"""Resource limits: one cgroup per sandbox (v1 or v2 layout) and rlimits as a backstop.

cgroup v1 mounts one hierarchy per controller (`/sys/fs/cgroup/memory/...`); v2 has one unified tree with
`memory.max`, `pids.max`, `cpu.max`. Sandbox groups are nested under the caller's own cgroup for each
controller, so whatever limits the caller runs under still apply to its sandboxes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import math
import os
import resource
import select
import shlex
import shutil
import signal
import time

from sandboxes.types import Limits

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
_PERIOD_US = 100_000  # CFS period for the `cpus` bandwidth limit


class CgroupError(OSError):
  """Creating or configuring a sandbox cgroup failed (e.g. cgroup v2 refuses controllers in a busy cgroup)."""


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _write(path: str, value: str) -> None:
  with open(path, "w") as f:
    f.write(value)


def _mounts(mountinfo: str) -> list[tuple[str, str, set[str]]]:
  """(mount point, fstype, super options) of the cgroup mounts in a /proc/self/mountinfo text."""
  out = []
  for line in mountinfo.splitlines():
    pre, _, post = line.partition(" - ")
    fields, post_fields = pre.split(), post.split()
    if len(post_fields) >= 3 and post_fields[0] in ("cgroup", "cgroup2"):
      out.append((fields[4], post_fields[0], set(post_fields[2].split(","))))
  return out


def _own_cgroups(proc_cgroup: str) -> dict[str, str]:
  """Maps controller name (or "" for v2) to this process's cgroup path, from a /proc/self/cgroup text."""
  own = {}
  for line in proc_cgroup.splitlines():
    _, ctrls, path = line.split(":", 2)
    for c in ctrls.split(",") if ctrls else [""]:
      own[c] = path
  return own


def detect_parents(mountinfo: str | None = None, proc_cgroup: str | None = None) -> dict[str, str]:
  """Maps each available controller to the directory under which sandbox groups are created.

  v1 wins for a controller that is mounted as v1 (this machine: memory, pids, cpu, cpuacct); otherwise the v2
  tree is used if it lists the controller (`cpuacct`'s job is done by v2's `cpu.stat`).

  Args:
    mountinfo, proc_cgroup: texts of /proc/self/mountinfo and /proc/self/cgroup (read when None).
  """
  own = _own_cgroups(proc_cgroup if proc_cgroup is not None else _read("/proc/self/cgroup"))
  parents: dict[str, str] = {}
  v2_root = None
  for point, fstype, opts in _mounts(mountinfo if mountinfo is not None else _read("/proc/self/mountinfo")):
    if fstype == "cgroup":
      for c in CONTROLLERS:
        if c in opts and c not in parents:
          parents[c] = os.path.normpath(point + own.get(c, "/"))
    elif v2_root is None:
      v2_root = point
  if v2_root is not None:
    base = os.path.normpath(v2_root + own.get("", "/"))
    try:
      available = set(_read(os.path.join(v2_root, "cgroup.controllers")).split())
    except OSError:
      available = set()
    for c in ("memory", "pids", "cpu"):
      if c in available and c not in parents:
        parents[c] = base
    if "cpu" in available and parents.get("cpu") == base and "cpuacct" not in parents:
      parents["cpuacct"] = base
  return {c: p for c, p in parents.items() if os.access(p, os.W_OK)}


def _is_v2(parent: str) -> bool:
  return os.path.exists(os.path.join(parent, "cgroup.controllers"))


class SandboxCgroup:
  """The cgroup(s) of one sandbox: created with limits applied, attached to in the child, removed on close."""

  def __init__(self, name: str, limits: Limits, parents: dict[str, str]):
    self.name = name
    self.limits = limits
    self.dirs: dict[str, str] = {}  # controller -> cgroup dir (several controllers share one dir on v2)
    self.v2 = {ctrl: _is_v2(parent) for ctrl, parent in parents.items()}
    try:
      for ctrl, parent in parents.items():
        path = os.path.join(parent, "composer_sandboxes", name)
        for attempt in range(3):  # a concurrent remove() may rmdir the shared parent between our two mkdirs
          try:
            if self.v2[ctrl]:
              self._enable_v2(parent, os.path.join(parent, "composer_sandboxes"))
            os.makedirs(path, exist_ok=True)
            break
          except FileNotFoundError:
            if attempt == 2:
              raise
        self.dirs[ctrl] = path
      self._apply()
    except OSError as e:
      self.remove()
      raise CgroupError(f"cannot set up cgroup {name!r} under {sorted(set(parents.values()))}: {e}") from e
    except BaseException:
      self.remove()
      raise
    self._cpu0 = self.cpu_seconds() or 0.0
    self._oom0 = self._oom_kills()
    self._pidmax0 = self._pids_max_events()

  @staticmethod
  def _enable_v2(parent: str, group: str) -> None:
    os.makedirs(group, exist_ok=True)
    wanted = set(_read(os.path.join(parent, "cgroup.controllers")).split()) & {"memory", "pids", "cpu"}
    for where in (parent, group):
      have = set(_read(os.path.join(where, "cgroup.subtree_control")).split())
      if wanted - have:
        _write(os.path.join(where, "cgroup.subtree_control"), " ".join(f"+{c}" for c in sorted(wanted - have)))

  def _apply(self) -> None:
    lim = self.limits
    if "memory" in self.dirs and lim.memory_bytes is not None:
      d = self.dirs["memory"]
      if self.v2["memory"]:
        _write(os.path.join(d, "memory.max"), str(lim.memory_bytes))
        if os.path.exists(os.path.join(d, "memory.swap.max")):
          _write(os.path.join(d, "memory.swap.max"), "0")
      else:
        _write(os.path.join(d, "memory.limit_in_bytes"), str(lim.memory_bytes))
        try:  # only present with swap accounting; memsw must be >= the memory limit, so it goes second
          _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(lim.memory_bytes))
        except OSError:
          pass
    if "pids" in self.dirs and lim.max_pids is not None:
      _write(os.path.join(self.dirs["pids"], "pids.max"), str(lim.max_pids))
    if "cpu" in self.dirs and lim.cpus is not None:
      d = self.dirs["cpu"]
      quota = max(1000, int(lim.cpus * _PERIOD_US))
      if self.v2["cpu"]:
        _write(os.path.join(d, "cpu.max"), f"{quota} {_PERIOD_US}")
      else:
        _write(os.path.join(d, "cpu.cfs_period_us"), str(_PERIOD_US))
        _write(os.path.join(d, "cpu.cfs_quota_us"), str(quota))

  def procs_files(self) -> list[str]:
    """The `cgroup.procs` files a child writes its pid into (deduplicated: v2 shares one dir)."""
    return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

  def pids(self) -> set[int]:
    out: set[int] = set()
    for f in self.procs_files():
      try:
        out.update(int(x) for x in _read(f).split())
      except OSError:
        pass
    return out

  def kill_all(self, rounds: int = 200) -> None:
    """SIGKILLs every process in the group until it is empty (a fork loop can race a single pass)."""
    for d in set(self.dirs.values()):
      kill_file = os.path.join(d, "cgroup.kill")
      if os.path.exists(kill_file):
        _write(kill_file, "1")
    for _ in range(rounds):
      pids = self.pids()
      if not pids:
        return
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      _wait_any_exit(pids, 0.002)

  def cpu_seconds(self) -> float | None:
    """Total CPU seconds used by the group since it was created."""
    d = self.dirs.get("cpuacct")
    try:
      if d is None:
        return None
      if not self.v2["cpuacct"]:
        return int(_read(os.path.join(d, "cpuacct.usage"))) / 1e9
      for line in _read(os.path.join(d, "cpu.stat")).splitlines():
        if line.startswith("usage_usec "):
          return int(line.split()[1]) / 1e6
    except (OSError, ValueError):
      pass
    return None

  def _kv(self, ctrl: str, fname: str, key: str) -> int:
    d = self.dirs.get(ctrl)
    if d is None or not os.path.exists(os.path.join(d, fname)):
      return 0
    for line in _read(os.path.join(d, fname)).splitlines():
      k, _, v = line.partition(" ")
      if k == key:
        return int(v)
    return 0

  def _oom_kills(self) -> int:
    return self._kv("memory", "memory.oom_control", "oom_kill") + self._kv("memory", "memory.events", "oom_kill")

  def _pids_max_events(self) -> int:
    return self._kv("pids", "pids.events", "max")

  def start_run(self) -> None:
    """Records counters so that `limit_hit` reports only what happened during the next run."""
    self._cpu0 = self.cpu_seconds() or 0.0
    self._oom0 = self._oom_kills()
    self._pidmax0 = self._pids_max_events()

  def run_cpu_seconds(self) -> float | None:
    cpu = self.cpu_seconds()
    return None if cpu is None else cpu - self._cpu0

  def limit_hit(self) -> str | None:
    """"memory" if the OOM killer fired in the group during the run, "pids" if a fork failed at pids.max."""
    if self._oom_kills() > self._oom0:
      return "memory"
    if self._pids_max_events() > self._pidmax0:
      return "pids"
    return None

  def remove(self) -> None:
    """Kills what is left and removes the group's directories."""
    if self.dirs:
      self.kill_all()
    for d in sorted(set(self.dirs.values())):
      remove_cgroup_dir(d)
      remove_if_empty(os.path.dirname(d))
    self.dirs = {}


def _wait_any_exit(pids: set[int], timeout: float) -> None:
  """Returns once one of `pids` has exited (so it has left its cgroup), or after `timeout` seconds.

  After a normal exit bwrap's own pid 1 is usually still finishing; a fixed sleep here cost every run 2-8 ms under
  load, a pidfd wakes us the moment it is gone.
  """
  poller, fds = select.poll(), []
  try:
    for pid in pids:
      try:
        fds.append(os.pidfd_open(pid))
      except ProcessLookupError:
        return  # already gone
      except (AttributeError, OSError):
        time.sleep(timeout)  # no pidfds (old kernel): poll the group again later
        return
      poller.register(fds[-1], select.POLLIN)
    poller.poll(timeout * 1000)
  finally:
    for fd in fds:
      os.close(fd)


def remove_if_empty(group_parent: str) -> None:
  """Removes the shared `composer_sandboxes` group once its last sandbox is gone, so that the caller's own cgroup
  is left as it was (a supervisor may want to rmdir it)."""
  try:
    os.rmdir(group_parent)
  except OSError:
    pass  # other sandboxes still live there, or it is already gone


def remove_cgroup_dir(d: str, tries: int = 100) -> None:
  """rmdir with retries: it fails with EBUSY while the last killed processes are being reaped."""
  for _ in range(tries):
    try:
      os.rmdir(d)
      return
    except FileNotFoundError:
      return
    except OSError as e:
      if e.errno != errno.EBUSY:
        raise
      try:
        for pid in _read(os.path.join(d, "cgroup.procs")).split():
          os.kill(int(pid), signal.SIGKILL)
      except (OSError, ValueError):
        pass
      time.sleep(0.01)
  raise OSError(errno.EBUSY, f"cgroup {d} still busy after {tries} tries")


def processes_of(uid: int) -> int:
  """How many processes `uid` has now (RLIMIT_NPROC counts them all, not just one sandbox's)."""
  n = 0
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        n += os.stat(f"/proc/{pid}").st_uid == uid
      except OSError:
        pass
  return n


def rlimits_for(limits: Limits, cgroup_controllers: set[str], nproc_base: int = 0) -> list[tuple[int, int, int]]:
  """(resource, soft, hard) to set in the child; backstops for what the cgroups cannot or do not cover.

  `nproc_base` is added to `max_pids` for RLIMIT_NPROC, which counts every process of the user.
  """
  out = [(resource.RLIMIT_NOFILE, limits.open_files, limits.open_files), (resource.RLIMIT_CORE, 0, 0)]
  if limits.file_size_bytes is not None:
    out.append((resource.RLIMIT_FSIZE, limits.file_size_bytes, limits.file_size_bytes))
  if limits.cpu_seconds is not None:
    # Per process and in whole seconds (SIGXCPU at soft, SIGKILL at hard): the cgroup poll enforces the exact
    # total; this catches a runaway process if the poll is unavailable.
    sec = math.ceil(limits.cpu_seconds) + 1
    out.append((resource.RLIMIT_CPU, sec, sec + 1))
  if limits.max_pids is not None and "pids" not in cgroup_controllers:
    out.append((resource.RLIMIT_NPROC, limits.max_pids + nproc_base, limits.max_pids + nproc_base))
  if limits.memory_bytes is not None and "memory" not in cgroup_controllers:
    out.append((resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes))
  return out


def apply_rlimits(triples: list[tuple[int, int, int]]) -> None:
  """Lowers soft and hard limits (never raises them: an unprivileged or capped parent cannot)."""
  for res, soft, hard in triples:
    _, cur_hard = resource.getrlimit(res)
    if cur_hard != resource.RLIM_INFINITY:
      soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(res, (soft, hard))


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_PR_SET_PDEATHSIG = 1

_PRLIMIT_NAMES = {resource.RLIMIT_NOFILE: "nofile", resource.RLIMIT_CORE: "core", resource.RLIMIT_FSIZE: "fsize",
                  resource.RLIMIT_CPU: "cpu", resource.RLIMIT_NPROC: "nproc", resource.RLIMIT_AS: "as"}


def rlimits_argv(rlimits: list[tuple[int, int, int]]) -> list[str] | None:
  """`prlimit --X=soft:hard ... --`, to put in front of a command; None where util-linux's prlimit is missing.

  Unlike a `preexec_fn` it lets `subprocess` vfork, which is also the only safe way to start a child from a
  multithreaded caller (a JAX process is one).
  """
  prlimit = shutil.which("prlimit")
  if not prlimit:
    return None
  argv = [prlimit]
  for res, soft, hard in rlimits:
    _, cur_hard = resource.getrlimit(res)  # inherited by the child: never ask for more than we have
    if cur_hard != resource.RLIM_INFINITY:
      soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    argv.append(f"--{_PRLIMIT_NAMES[res]}={soft}:{hard}")
  return argv + ["--"]


def launcher_argv(procs_files: list[str], rlimits: list[tuple[int, int, int]], uid: int | None = None,
                  gid: int | None = None) -> list[str] | None:
  """An exec chain doing what `make_preexec` does, or None if `prlimit`/`setpriv` (util-linux) are missing.

  `sh` joins the cgroups, `prlimit` sets the rlimits and `setpriv` drops to uid/gid, each exec'ing the next and
  finally the command. This lets `subprocess` use vfork: a `preexec_fn` forces a real fork(), whose cost grows
  with the caller's memory (measured: ~300 ms from a process with 2 GB resident, vs ~3 ms for vfork), and RL
  workers that sandbox commands often hold a model in memory.
  """
  sh, setpriv, prlimit = shutil.which("sh"), shutil.which("setpriv"), rlimits_argv(rlimits)
  if not (sh and setpriv and prlimit):
    return None
  script = "".join(f"echo $$ > {shlex.quote(f)} && " for f in procs_files) + 'exec "$@"'
  # The first setpriv arms the parent-death signal at once (so a caller that dies mid-launch takes the launch
  # with it); the uid change clears it, so the second setpriv arms it again; bwrap then sets its own.
  argv = [setpriv, "--pdeathsig=KILL", "--", sh, "-c", script, "sh"] + prlimit
  if uid is not None or gid is not None:
    argv += [setpriv, "--pdeathsig=KILL", "--clear-groups"]
    argv += [f"--regid={gid}"] if gid is not None else []
    argv += [f"--reuid={uid}"] if uid is not None else []
    argv.append("--")
  return argv


def make_preexec(procs_files: list[str], rlimits: list[tuple[int, int, int]], uid: int | None = None,
                 gid: int | None = None):
  """The child-side set-up before exec: join the cgroups (so no descendant escapes them), set rlimits, and drop
  to the unprivileged host uid/gid (last: joining root-owned cgroups needs root)."""

  parent = os.getpid()

  def preexec() -> None:
    pid = str(os.getpid()).encode()
    for f in procs_files:
      fd = os.open(f, os.O_WRONLY)
      try:
        os.write(fd, pid)
      finally:
        os.close(fd)
    apply_rlimits(rlimits)
    if gid is not None:
      os.setgroups([])
      os.setresgid(gid, gid, gid)
    if uid is not None:
      os.setresuid(uid, uid, uid)
    # Armed after the uid change (which clears it); if the caller already died, nobody would reap us: stop.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
      os._exit(125)

  return preexec
