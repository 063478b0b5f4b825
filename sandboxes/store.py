"""Where a backend keeps its layers and sandboxes on the host, and cleaning up after owners that died.

Layout (short paths: every lower layer is spelled out in the overlay mount options, which must fit one page):

  <state_root>/<pid>-<start>-<rand>/owner      "pid starttime" of the owning process
                                    /cgroups    one cgroup dir per line, appended as sandboxes are made
                                    /l/<n>      lower layers (immutable once written)
                                    /s/<n>/{u,w,m}  per sandbox: overlay upper, work dir, merged mount point
                                    /ro/<n>     read-only bind mounts of host dirs shown inside (e.g. the host
                                                Python under /root, which the unprivileged bwrap cannot reach)
"""

from __future__ import annotations

import itertools
import os
import secrets
import tempfile
import threading
import time
import warnings

from sandboxes import limits, overlay
from sandboxes.types import SandboxError

# Per user: a non-root (rootless) user cannot use root's state dir.
DEFAULT_STATE_ROOT = os.path.join(
  tempfile.gettempdir(), "composer_sandboxes" if os.geteuid() == 0 else f"composer_sandboxes-{os.geteuid()}")


def _start_time(pid: int) -> str | None:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]  # field 22 (starttime), counted after the comm field
  except (OSError, IndexError):
    return None


def _owner_alive(store: str) -> bool:
  try:
    with open(os.path.join(store, "owner")) as f:
      pid, start = f.read().split()
  except (OSError, ValueError):
    return False  # a store without a valid owner file is debris from a crash during creation
  return _start_time(int(pid)) == start


class Store:
  """One backend instance's state directory.

  Args:
    state_root: the shared parent dir (made 0711: traversable, not listable).
    group: as root, the sandbox's host gid: the store is root:group 0710, so bwrap (run as that gid) reaches the
      workspaces and staged binds in it and no other host user does; None (rootless, where bwrap runs as the
      caller): 0700.
  """

  def __init__(self, state_root: str | None = None, group: int | None = None):
    self.state_root = os.path.abspath(state_root or DEFAULT_STATE_ROOT)
    self.made_state_root = not os.path.exists(self.state_root)  # removed again if the backend fails to start
    # 0o711: the unprivileged sandbox uid must traverse to its workspace and staged binds, but not list stores.
    os.makedirs(self.state_root, mode=0o711, exist_ok=True)
    os.chmod(self.state_root, 0o711)
    cleanup(self.state_root)
    pid = os.getpid()
    self.path = os.path.join(self.state_root, f"{pid}-{secrets.token_hex(3)}")
    # Built under a ".tmp" name and renamed, so a concurrent cleanup never sees a store without its owner file.
    tmp = self.path + ".tmp"
    for sub in ("l", "s", "ro"):
      os.makedirs(os.path.join(tmp, sub), mode=0o711)
    if group is not None:
      os.chown(tmp, 0, group)
    os.chmod(tmp, 0o700 if group is None else 0o710)
    with open(os.path.join(tmp, "owner"), "w") as f:
      f.write(f"{pid} {_start_time(pid)}\n")
    os.rename(tmp, self.path)
    self._ids = itertools.count()
    self._lock = threading.Lock()

  def new_id(self) -> str:
    return f"{next(self._ids):x}"

  def new_layer_dir(self) -> str:
    return os.path.join(self.path, "l", self.new_id())

  def new_sandbox_dir(self) -> str:
    return os.path.join(self.path, "s", self.new_id())

  def new_bind_dir(self) -> str:
    return os.path.join(self.path, "ro", self.new_id())

  def record_cgroups(self, dirs: list[str]) -> None:
    with self._lock, open(os.path.join(self.path, "cgroups"), "a") as f:
      f.write("".join(d + "\n" for d in dirs))

  def owns_layer(self, layer: str) -> bool:
    return os.path.dirname(layer) == os.path.join(self.path, "l")

  def remove(self) -> None:
    remove_store(self.path)

  def remove_state_root_if_made(self) -> None:
    """After a failed start: removes the state root too if this store created it and it is empty now."""
    if self.made_state_root:
      try:
        os.rmdir(self.state_root)
      except OSError:
        pass  # another backend uses it meanwhile


def remove_store(path: str) -> None:
  """Kills processes left in the store's cgroups, removes the cgroups, unmounts everything and deletes the dir."""
  try:
    with open(os.path.join(path, "cgroups")) as f:
      cgroup_dirs = [line.strip() for line in f if line.strip()]
  except FileNotFoundError:
    cgroup_dirs = []
  for d in cgroup_dirs:
    try:
      limits.remove_cgroup_dir(d)
      limits.remove_if_empty(os.path.dirname(d))
    except OSError:
      pass  # retried by the next cleanup if it is really stuck
  overlay.remove_tree(path)


def cleanup(state_root: str | None = None) -> list[str]:
  """Removes the stores of dead owners (e.g. a process that was SIGKILLed): processes, cgroups, mounts, files.

  Called automatically whenever a backend starts; safe to call at any time, it never touches a live owner's store.

  Returns:
    The store directories removed.
  """
  root = os.path.abspath(state_root or DEFAULT_STATE_ROOT)
  if not os.path.isdir(root):
    return []
  removed = []
  for name in sorted(os.listdir(root)):
    path = os.path.join(root, name)
    try:
      if name.endswith(".tmp") and time.time() - os.lstat(path).st_mtime < 60:
        continue  # being created right now
      if os.path.isdir(path) and not _owner_alive(path):
        remove_store(path)
        removed.append(path)
    except OSError as e:  # one store we cannot remove must not disable sandboxing for everyone else
      warnings.warn(f"could not remove the stale sandbox store {path}: {e}; the next cleanup retries",
                    RuntimeWarning, stacklevel=2)
  return removed


def check_traversable(path: str, uid: int, gid: int) -> None:
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
