"""Host-side file access to a sandbox's workspace that cannot be tricked into leaving it, nor into blocking.

Commands inside may plant symlinks such as `notes -> /etc/shadow` or `x -> ../../..`, swap a directory for a
symlink while the host is looking, or leave a FIFO where the host expects a file. So:

- paths are resolved component by component from a directory fd (`openat` with `O_NOFOLLOW`), as if `root` were
  `/workspace`: a link is read and its target resolved the same way (absolute targets under /workspace are
  re-rooted), and anything that would leave the root — `..` above it, a link outside — is a `SandboxError`.
  What was checked is what is opened: a link swapped in after the check makes the open fail, never follow it;
- every open is `O_NONBLOCK | O_NOFOLLOW`, and anything that is not a regular file or a directory is refused;
- deletion is iterative (`rmtree`), so no depth of nesting can make it fail.

A user path is first normalised lexically (`a/../b` is `b`); one that then still starts with `..` is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat

from sandboxes.types import WORKSPACE, SandboxError

_MAX_LINKS = 40  # like the kernel's ELOOP bound
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def to_relative(path: str | os.PathLike) -> str:
  """The normalised workspace-relative form of a user path (relative, or absolute under /workspace; a str or a
  `pathlib` path).

  Raises:
    ValueError: not a non-empty string (or path object) without NUL bytes.
    SandboxError: the path leaves the workspace.
  """
  if isinstance(path, os.PathLike):
    path = os.fspath(path)
  if not isinstance(path, str) or not path or "\0" in path:
    raise ValueError(f"path must be a non-empty string without NUL bytes, got {path!r}")
  norm = posixpath.normpath(path)
  if norm.startswith("//"):
    norm = "/" + norm.lstrip("/")  # POSIX keeps a leading "//"; it means "/" here
  if os.path.isabs(norm):
    if norm != WORKSPACE and not norm.startswith(WORKSPACE + "/"):
      raise SandboxError(f"path {path!r} is outside the workspace {WORKSPACE}")
    norm = norm[len(WORKSPACE):].lstrip("/") or "."
  if norm == ".." or norm.startswith("../"):
    raise SandboxError(f"path {path!r} is outside the workspace {WORKSPACE}")
  return norm


def check_file_name(path: str | os.PathLike) -> None:
  """Refuses a path that names a directory (`new/`, `new/.`): writing it would make a file the caller did not
  name. (`pathlib` drops a trailing slash, so only strings can hold one.)"""
  to_relative(path)  # the type and range checks first, with their messages
  if isinstance(path, str) and (path.endswith("/") or path.endswith("/.")):
    raise IsADirectoryError(errno.EISDIR, "a file name is needed, not a directory path", path)


def _parts(path: str) -> list[str]:
  return [p for p in path.split("/") if p and p != "."]


def _kind(mode: int) -> str:
  for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                     (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory")):
    if test(mode):
      return name
  return "special file"


class _At:
  """Where a resolved path ends: an open fd of its parent directory and the last component's name ("." for the
  root itself), plus the host path for messages. Use as a context manager (closes the fd)."""

  def __init__(self, fd: int, name: str, host: str):
    self.fd, self.name, self.host = fd, name, host

  def lstat(self) -> os.stat_result:
    return os.stat(self.name, dir_fd=self.fd, follow_symlinks=False)

  def __enter__(self) -> _At:
    return self

  def __exit__(self, *exc) -> None:
    os.close(self.fd)


def _link_target(fds: list[int], names: list[str], link: str, path: str) -> list[str]:
  """The components a symlink named `link` (in the directory fds[-1]) stands for. An absolute target under
  /workspace restarts from the root (fds and names are cut back to it); any other absolute target is refused."""
  target = os.readlink(link, dir_fd=fds[-1])
  if os.path.isabs(target):
    norm = posixpath.normpath(target)
    if norm != WORKSPACE and not norm.startswith(WORKSPACE + "/"):
      raise SandboxError(f"{path!r} goes through a symlink to {target!r}, outside the workspace")
    while len(fds) > 1:
      os.close(fds.pop())
    names.clear()
    target = norm[len(WORKSPACE):]
  return _parts(target)


def _walk(root: str, path: str, follow_final: bool = True, make_dirs: tuple[int, int] | None | bool = False) -> _At:
  """Resolves `path` under `root` by directory fds without ever leaving `root`.

  Args:
    follow_final: whether a symlink as the last component is followed (False for remove).
    make_dirs: create missing parent directories (False: they must exist); a (uid, gid) also chowns them.
  """
  todo = _parts(to_relative(path))[::-1]  # a stack: next component last
  fds = [os.open(root, _DIR)]
  names: list[str] = []
  links = 0
  try:
    while todo:
      comp = todo.pop()
      if comp == "..":
        if not names:
          raise SandboxError(f"{path!r} resolves outside the workspace (a '..' above its root)")
        os.close(fds.pop())
        names.pop()
        continue
      last = not todo
      try:
        st = os.stat(comp, dir_fd=fds[-1], follow_symlinks=False)
      except FileNotFoundError:
        if last:
          break
        if make_dirs is False:
          raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None
        os.mkdir(comp, 0o755, dir_fd=fds[-1])
        if isinstance(make_dirs, tuple):
          os.chown(comp, *make_dirs, dir_fd=fds[-1], follow_symlinks=False)
        st = os.stat(comp, dir_fd=fds[-1], follow_symlinks=False)
      if stat.S_ISLNK(st.st_mode) and (follow_final or not last):
        links += 1
        if links > _MAX_LINKS:
          raise OSError(errno.ELOOP, f"too many symlinks resolving {path!r}")
        todo.extend(_link_target(fds, names, comp, path)[::-1])
        continue
      if last:
        break
      if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
      try:
        fds.append(os.open(comp, _DIR, dir_fd=fds[-1]))
      except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
          raise
        todo.append(comp)  # swapped for a link since the stat: look again (bounded by the link count)
        links += 1
        continue
      names.append(comp)
    else:
      comp = "."
    return _At(fds.pop(), comp, os.path.join(root, *names, comp))
  finally:
    for fd in fds:
      os.close(fd)


def resolve_in_root(root: str, path: str, follow_final: bool = True) -> str:
  """Host path of workspace path `path` under `root` (it may not exist yet); for messages and tests."""
  with _walk(root, path, follow_final) as at:
    return os.path.normpath(at.host)


def _open_regular(at: _At, path: str, flags: int, mode: int = 0o644) -> int:
  """Opens the resolved entry without following a link or blocking; refuses anything but a regular file."""
  if at.name == ".":
    raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
  try:
    fd = os.open(at.name, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=at.fd)
  except OSError as e:
    if e.errno in (errno.ENXIO, errno.ELOOP, errno.EOPNOTSUPP):  # FIFO without a reader, link, socket
      raise SandboxError(f"{path!r} is a {_kind(at.lstat().st_mode)}, not a regular file") from None
    raise
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode):
    os.close(fd)
    if stat.S_ISDIR(st.st_mode):
      raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    raise SandboxError(f"{path!r} is a {_kind(st.st_mode)}, not a regular file")
  return fd


def read_file(root: str, path: str, max_bytes: int | None = None) -> bytes:
  with _walk(root, path) as at:
    fd = _open_regular(at, path, os.O_RDONLY)
  with os.fdopen(fd, "rb") as f:
    return f.read() if max_bytes is None else f.read(max_bytes)


def write_file(root: str, path: str, data: bytes | str, mode: int = 0o644,
               owner: tuple[int, int] | None = None) -> None:
  """Writes a file, creating parent dirs; new entries get `owner` (uid, gid) so the sandbox user can edit them."""
  if isinstance(data, str):
    data = data.encode()
  if not isinstance(data, bytes | bytearray | memoryview):
    raise TypeError(f"data must be bytes or str, got {type(data).__name__}")
  check_file_name(path)
  with _walk(root, path, make_dirs=owner if owner is not None else True) as at:
    fd = _open_regular(at, path, os.O_WRONLY | os.O_CREAT, mode)
  with os.fdopen(fd, "wb") as f:
    f.truncate(0)  # only now: O_TRUNC would have emptied a file before we knew what it was
    f.write(data)
    if owner is not None:
      os.fchown(f.fileno(), *owner)


def list_dir(root: str, path: str = ".") -> list[str]:
  with _walk(root, path) as at:
    try:
      fd = os.open(at.name, _DIR, dir_fd=at.fd)
    except OSError as e:
      if e.errno == errno.ENOTDIR:
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path) from None
      raise
  try:
    return sorted(os.listdir(fd))
  finally:
    os.close(fd)


def exists(root: str, path: str) -> bool:
  """Whether the path names anything (a dangling link inside the workspace counts as missing)."""
  try:
    with _walk(root, path) as at:
      at.lstat()
      return True
  except (FileNotFoundError, NotADirectoryError):
    return False


def remove(root: str, path: str) -> None:
  """Removes a file, a symlink (not its target) or a directory tree."""
  with _walk(root, path, follow_final=False) as at:
    if at.name == ".":
      raise SandboxError("refusing to remove the workspace root")
    if stat.S_ISDIR(at.lstat().st_mode):
      _rmtree_at(at.fd, at.name)
    else:
      os.unlink(at.name, dir_fd=at.fd)


def rmtree(path: str) -> None:
  """`rm -rf path` without recursion or path-length limits (a 10,000-deep tree is fine); never follows links.

  Missing is fine, and so is what goes missing meanwhile (two cleanups deleting the same dead store at once).
  Read-only directories are made writable on the way (needed when not root).
  """
  parent, name = os.path.split(os.path.abspath(path))
  try:
    pfd = os.open(parent, _DIR)
  except FileNotFoundError:
    return
  try:
    try:
      st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
      return
    if stat.S_ISDIR(st.st_mode):
      _rmtree_at(pfd, name)
    else:
      with contextlib.suppress(FileNotFoundError):   # deleted meanwhile by someone else
        os.unlink(name, dir_fd=pfd)
  finally:
    os.close(pfd)


def _id(fd: int) -> tuple[int, int]:
  st = os.fstat(fd)
  return st.st_dev, st.st_ino


def _unless_gone(op, unlock):
  """op(), again after unlock() if it was denied (a dir the command made read-only or unreadable: matters when not
  root); None if what it acts on is gone (someone else deleted it meanwhile)."""
  try:
    try:
      return op()
    except PermissionError:
      unlock()
      return op()
  except FileNotFoundError:
    return None


def _open_dir(dir_fd: int, name: str) -> int | None:
  """The directory `name` in `dir_fd`, opened; None if it is gone."""
  return _unless_gone(lambda: os.open(name, _DIR, dir_fd=dir_fd), lambda: os.chmod(name, 0o700, dir_fd=dir_fd))


def _clear_files(fd: int) -> list[str]:
  """Unlinks every non-directory in the directory `fd`; returns the names of its subdirectories."""
  subdirs = []
  with os.scandir(fd) as it:
    for e in it:
      if e.is_dir(follow_symlinks=False):
        subdirs.append(e.name)
        continue
      _unless_gone(lambda name=e.name: os.unlink(name, dir_fd=fd), lambda: os.chmod(fd, 0o700))
  return subdirs


def _rmdir(dir_fd: int, name: str) -> None:
  _unless_gone(lambda: os.rmdir(name, dir_fd=dir_fd), lambda: os.chmod(dir_fd, 0o700))


def _rmtree_at(parent_fd: int, name: str) -> None:
  """Deletes the directory `name` in `parent_fd` depth first with an explicit stack and one open fd at a time.

  Going down opens each child from its parent (never following a link); going up opens ".." and checks it is the
  directory we came from (so a tree moved meanwhile stops the deletion instead of redirecting it). A directory
  deleted under it by someone else still leads up to the one it came from (Linux resolves ".." of an unlinked
  directory), so only what it then finds gone is skipped.
  """
  fd = _open_dir(parent_fd, name)
  if fd is None:
    return
  try:
    path = [name]  # names from parent_fd down to fd
    parents = [_id(parent_fd)]  # identity of the directory holding path[i]
    todo = [_clear_files(fd)]  # per level: subdirectories still to delete
    while True:
      if todo[-1]:
        sub = todo[-1].pop()
        child = _open_dir(fd, sub)
        if child is None:
          continue
        parents.append(_id(fd))
        path.append(sub)
        os.close(fd)
        fd = child
        todo.append(_clear_files(fd))
        continue
      todo.pop()
      if len(path) == 1:
        break
      up = os.open("..", _DIR, dir_fd=fd)
      os.close(fd)
      fd = up
      if _id(up) != parents[-1]:
        raise OSError(errno.ESTALE, f"a directory below {name!r} was moved while it was being deleted")
      parents.pop()
      _rmdir(fd, path.pop())
  finally:
    os.close(fd)
  _rmdir(parent_fd, name)
