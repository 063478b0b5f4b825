"""Overlayfs layers: mount a stack (immutable lowers + one upper/work per fork), freeze an upper into a layer, flatten.

A snapshot is a tuple of lower layer directories, topmost first. A fork mounts them under its own empty
upper dir; a snapshot of a stopped fork moves its upper dir in as the new top layer (whiteouts and opaque-dir
xattrs in it keep working as a lower layer). The kernel stacks at most 500 lowers and the whole mount option
string must fit one page, so long chains are flattened into a single copied layer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess

from sandboxes import fsops

MAX_KERNEL_LAYERS = 500
MAX_OPTIONS_BYTES = 4000  # mount(2) data is one page (4096) including the NUL; keep a margin
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384


def _check_path(p: str) -> str:
  # overlayfs splits options on ',' and lowerdir on ':'; our store paths never contain them, so reject loudly.
  if "," in p or ":" in p or not os.path.isabs(p):
    raise ValueError(f"overlay layer paths must be absolute without ',' or ':', got {p!r}")
  return p


def mount_options(layers: tuple[str, ...], upper: str | None = None, work: str | None = None) -> str:
  opts = "lowerdir=" + ":".join(_check_path(p) for p in layers)
  if upper is not None:
    # metacopy=off: an upper file must hold its data, because the upper dir later becomes a lower layer on its
    # own; index=off: no inode index tying the upper to these exact lower dirs.
    opts += f",upperdir={_check_path(upper)},workdir={_check_path(work)},index=off,metacopy=off"
  return opts


def fits(layers: tuple[str, ...], upper: str, work: str) -> bool:
  """Whether a mount of these layers is within the kernel's layer-count and option-size limits."""
  return len(layers) <= MAX_KERNEL_LAYERS and len(mount_options(layers, upper, work)) <= MAX_OPTIONS_BYTES


def mount(layers: tuple[str, ...], target: str, upper: str | None = None, work: str | None = None) -> None:
  """Mounts an overlay at `target`; read-only when `upper` is None (then at least one layer is needed).

  `nosuid,nodev`: the mount is on the host, listed in every user's /proc/self/mountinfo; a setuid file a command
  made in it must not run as the sandbox's uid for anyone who reaches it (inside, bwrap's binds are nosuid too).
  """
  if not layers:
    raise ValueError("an overlay needs at least one lower layer")
  opts = mount_options(layers, upper, work)
  if len(opts) > MAX_OPTIONS_BYTES:
    raise ValueError(f"overlay options are {len(opts)} bytes (> {MAX_OPTIONS_BYTES}); flatten the snapshot first")
  flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if upper is None else 0)
  if upper is None and len(layers) == 1:
    opts = f"lowerdir={layers[0]}:{layers[0]}"  # overlayfs wants 2+ lowers without an upper; same dir twice is fine
  if _libc.mount(b"overlay", target.encode(), b"overlay", flags, opts.encode()) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount overlay at {target} failed: {os.strerror(err)} (options: {opts[:200]}...)")


def mount_tmpfs(target: str, size_bytes: int | None, inodes: int | None, mode: int = 0o755) -> None:
  """A private tmpfs at `target`: the kernel refuses writes past `size_bytes` or `inodes` with ENOSPC.

  tmpfs pages are charged to the memory cgroup of the process that writes them, so a sandbox's files count
  towards its memory limit too; unmounting frees them at once, however deep or many they are.
  """
  opts = f"mode={mode:o},size={size_bytes or 0},nr_inodes={inodes or 0}"  # 0: unlimited
  if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount tmpfs at {target} ({opts}) failed: {os.strerror(err)}")


def mount_devpts(target: str, max_ptys: int) -> None:
  """A new devpts instance at `target` holding at most `max_ptys` ptys (bwrap binds it at the sandbox's /dev/pts).

  bwrap's own instance has no `max`: every non-host instance draws on the kernel's one shared budget.
  """
  opts = f"newinstance,ptmxmode=0666,mode=0620,max={max_ptys}"
  if _libc.mount(b"devpts", target.encode(), b"devpts", MS_NOSUID | MS_NOEXEC, opts.encode()) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount devpts at {target} ({opts}) failed: {os.strerror(err)}")


def bind_readonly(src: str, target: str) -> None:
  """Read-only bind mount of host `src` at `target` (read-only so that no rm -rf can ever go through it)."""
  if _libc.mount(src.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"bind mount {src} -> {target} failed: {os.strerror(err)}")
  if _libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) != 0:
    err = ctypes.get_errno()
    umount(target)
    raise OSError(err, f"read-only remount of {target} failed: {os.strerror(err)}")


def umount(target: str, lazy: bool = False) -> None:
  if _libc.umount2(target.encode(), MNT_DETACH if lazy else 0) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"umount {target} failed: {os.strerror(err)}")


def mounts_under(prefix: str) -> list[str]:
  """Mount points at or below `prefix` in this mount namespace, deepest first."""
  prefix = os.path.normpath(prefix)
  out = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      point = line.split()[4].encode().decode("unicode_escape")  # mountinfo octal-escapes spaces etc.
      if point == prefix or point.startswith(prefix + "/"):
        out.append(point)
  return sorted(out, key=len, reverse=True)


def copy_tree(src: str, dst: str, owner: tuple[int, int] | None = None, preserve_owner: bool = False) -> None:
  """Copies a directory's contents with modes, times, links and xattrs (cp -a is fast).

  Args:
    src, dst: source dir and destination dir (created if missing).
    owner: (uid, gid) to give every copied entry, e.g. the sandbox's host uid so it can edit the files.
    preserve_owner: keep the source's owners (flattening layers); else the copy belongs to the caller.
  """
  os.makedirs(dst, exist_ok=True)
  cmd = ["cp", "-a", "--reflink=auto"] + ([] if preserve_owner else ["--no-preserve=ownership"])
  r = subprocess.run(cmd + [src.rstrip("/") + "/.", dst], capture_output=True, text=True)
  if r.returncode != 0:
    raise OSError(f"copying {src} to {dst} failed: {r.stderr.strip()}")
  if owner is not None:
    r = subprocess.run(["chown", "-R", "--no-dereference", f"{owner[0]}:{owner[1]}", dst], capture_output=True,
                       text=True)
    if r.returncode != 0:
      raise OSError(f"chown of {dst} failed: {r.stderr.strip()}")


def flatten(layers: tuple[str, ...], dst: str, scratch: str) -> None:
  """Writes the merged view of `layers` into the new single layer `dst` (scratch: an empty dir for the mount)."""
  if len(layers) == 1:
    copy_tree(layers[0], dst, preserve_owner=True)
    return
  os.makedirs(scratch, exist_ok=True)
  mount(layers, scratch)
  try:
    copy_tree(scratch, dst, preserve_owner=True)
  finally:
    umount(scratch)
    os.rmdir(scratch)


def remove_tree(path: str) -> None:
  """rm -rf that first unmounts everything below `path`, and refuses to delete if a mount is left.

  Staged host binds (e.g. the host Python) live below the store: deleting through one would delete host files.
  """
  for m in mounts_under(path):
    try:
      umount(m)
    except OSError:
      umount(m, lazy=True)  # busy (a process still has it open): detach it from the tree instead
  left = mounts_under(path)
  if left:
    raise OSError(f"refusing to delete {path}: still mounted below it: {left}")
  fsops.rmtree(path)  # iterative: no depth of nesting a command made can make it fail
