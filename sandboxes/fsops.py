"""Host-side file access to a sandbox's workspace that cannot be tricked into leaving it.

Commands inside may plant symlinks such as `notes -> /etc/shadow` or `x -> ../../..`; a host-side
`open(root/notes)` would follow them into the host. Paths are therefore resolved component by component as if
`root` were `/workspace` (absolute link targets under /workspace are re-rooted, others are refused).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

from sandboxes.types import WORKSPACE, SandboxError

_MAX_LINKS = 40  # like the kernel's ELOOP bound


def _parts(path: str) -> list[str]:
  return [p for p in path.split("/") if p and p != "."]


def to_relative(path: str) -> str:
  """Workspace-relative form of a user path: relative paths and /workspace/... are accepted."""
  if not isinstance(path, str) or "\0" in path:
    raise ValueError(f"path must be a string without NUL bytes, got {path!r}")
  if os.path.isabs(path):
    norm = os.path.normpath(path)
    if norm != WORKSPACE and not norm.startswith(WORKSPACE + "/"):
      raise SandboxError(f"path {path!r} is outside the workspace {WORKSPACE}")
    return path[len(WORKSPACE):].lstrip("/") or "."
  return path


def resolve_in_root(root: str, path: str, follow_final: bool = True) -> str:
  """Host path of workspace path `path` under `root`, following symlinks without ever leaving `root`.

  Args:
    root: the host directory that is /workspace inside the sandbox.
    path: relative to the workspace, or absolute under /workspace.
    follow_final: whether a symlink as the last component is followed (False for remove).

  Returns:
    A host path under `root` (it may not exist yet).
  """
  todo = _parts(to_relative(path))[::-1]  # a stack: next component last
  done: list[str] = []
  links = 0
  while todo:
    comp = todo.pop()
    if comp == "..":
      if done:
        done.pop()
      continue
    host = os.path.join(root, *done, comp)
    try:
      st = os.lstat(host)
    except FileNotFoundError:
      done.append(comp)
      continue
    if stat.S_ISLNK(st.st_mode) and (todo or follow_final):
      links += 1
      if links > _MAX_LINKS:
        raise OSError(errno.ELOOP, f"too many symlinks resolving {path!r}")
      target = os.readlink(host)
      if os.path.isabs(target):
        norm = os.path.normpath(target)
        if norm != WORKSPACE and not norm.startswith(WORKSPACE + "/"):
          raise SandboxError(f"{path!r} is a symlink to {target!r}, outside the workspace")
        done = []
        target = norm[len(WORKSPACE):]
      todo.extend(_parts(target)[::-1])
      continue
    done.append(comp)
  return os.path.join(root, *done)


def read_file(root: str, path: str, max_bytes: int | None = None) -> bytes:
  host = resolve_in_root(root, path)
  with open(host, "rb") as f:
    return f.read() if max_bytes is None else f.read(max_bytes)


def write_file(root: str, path: str, data: bytes | str, mode: int = 0o644,
               owner: tuple[int, int] | None = None) -> None:
  """Writes a file, creating parent dirs; new entries get `owner` (uid, gid) so the sandbox user can edit them."""
  if isinstance(data, str):
    data = data.encode()
  host = resolve_in_root(root, path)
  missing = []
  d = os.path.dirname(host)
  while not os.path.isdir(d):
    missing.append(d)
    d = os.path.dirname(d)
  for d in reversed(missing):
    os.mkdir(d)
    if owner is not None:
      os.chown(d, *owner)
  # The path is fully resolved; O_NOFOLLOW guards against a link appearing at the last step.
  fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
    if owner is not None:
      os.fchown(f.fileno(), *owner)


def list_dir(root: str, path: str = ".") -> list[str]:
  return sorted(os.listdir(resolve_in_root(root, path)))


def remove(root: str, path: str) -> None:
  """Removes a file, a symlink (not its target) or a directory tree."""
  host = resolve_in_root(root, path, follow_final=False)
  if os.path.normpath(host) == os.path.normpath(root):
    raise SandboxError("refusing to remove the workspace root")
  if os.path.isdir(host) and not os.path.islink(host):
    shutil.rmtree(host)
  else:
    os.unlink(host)
