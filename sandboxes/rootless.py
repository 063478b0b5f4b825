"""Rootless forks: bwrap run by an ordinary user mounts the overlay itself, inside each sandbox.

Nothing is mounted on the host (an ordinary user may not), so:
- the upper dir is a plain directory in the store, and `disk_bytes` is enforced by walking it every
  `disk_poll_s` during a run (a fast writer overshoots by what it writes in one period; no inode limit);
- host-side file calls run a short command in the sandbox (a few ms each), so paths are resolved in the
  sandbox's own view and a planted link to `/etc/passwd` reads the sandbox's synthesized file, never the host's;
- a snapshot renames the upper dir into a layer; flattening copies a read-only overlay from inside a sandbox.
"""

from __future__ import annotations

import errno
import os
import time

from sandboxes import fsops, overlay, scan
from sandboxes.namespaced import BwrapSandbox
from sandboxes.types import WORKSPACE, RunResult, SandboxError


def _inside(path: str) -> str:
  """The absolute in-sandbox path of a workspace path (validated like the host-side calls)."""
  return os.path.normpath(os.path.join(WORKSPACE, fsops.to_relative(path)))


# Refuses (with the messages _file_cmd maps to exceptions) anything at "$1" but a regular file.
_REGULAR = ('if [ ! -e "$1" ]; then echo "$1: No such file or directory" >&2; exit 1; '
            'elif [ -d "$1" ]; then echo "$1: Is a directory" >&2; exit 1; '
            'elif [ ! -f "$1" ]; then echo "$1: not a regular file" >&2; exit 1; fi; ')


class RootlessSandbox(BwrapSandbox):
  """A fork whose overlay bwrap mounts inside the sandbox on every run."""

  _next_disk_check = 0.0

  def _mount(self) -> None:
    os.makedirs(self.upper, exist_ok=True)
    os.makedirs(self.work, exist_ok=True)

  def _workspace(self):
    return (self.layers, self.upper, self.work)

  def _layer_full(self) -> str | None:
    return None

  def _poll_disk(self) -> str | None:
    limit = self.config.limits.disk_bytes
    if limit is None or time.monotonic() < self._next_disk_check:
      return None
    self._next_disk_check = time.monotonic() + self.config.limits.disk_poll_s
    return "disk" if scan.tree_bytes(self.upper, stop_above=limit) > limit else None

  def _freeze_upper(self, layer: str) -> None:
    os.rename(self.upper, layer)
    overlay.remove_tree(self.work)  # holds a "work" dir from the old mounts

  def _flatten(self, flat: str) -> None:
    """Copies a read-only overlay of the layers into `flat` from inside a sandbox."""
    os.makedirs(flat)
    r = self._launch(["cp", "-a", WORKSPACE + "/.", "/flat/"], 3600, None, {}, workspace=(self.layers, None, None),
                     rw_binds=[(flat, "/flat")])
    if not r.ok:
      raise SandboxError(f"flattening {len(self.layers)} layers failed: {r.stderr_text.strip()}")

  def _remount(self) -> None:
    self._mount()

  # -- file access: there is no merged view on the host, so it goes through commands in the sandbox ----------
  def _file_cmd(self, argv: list[str], path: str, stdin: bytes | None = None,
                output_limit: int | None = None) -> RunResult:
    with self._lock:
      self._check_open()
      r = self._launch(argv, 600, stdin, {}, output_limit=output_limit)
    if r.exit_code != 0:
      err = r.stderr_text.strip()
      if "No such file" in err:
        raise FileNotFoundError(errno.ENOENT, f"{err}", path)
      if "Is a directory" in err:
        raise IsADirectoryError(errno.EISDIR, f"{err}", path)
      if "not a regular file" in err:
        raise SandboxError(f"{path!r} is not a regular file")
      raise OSError(f"{argv[0]} {path!r} in the sandbox failed (exit {r.exit_code}): {err}")
    return r

  def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
    p = _inside(path)
    # The type check first: cat on a FIFO would wait for a writer until the timeout.
    if max_bytes is None:  # its size too: the output cap must fit the whole file
      size = int(self._file_cmd(["sh", "-c", _REGULAR + 'stat -L -c %s -- "$1"', "sh", p], path).stdout)
      return self._file_cmd(["cat", "--", p], path, output_limit=max(2, size + 1)).stdout
    return self._file_cmd(["sh", "-c", _REGULAR + 'head -c "$2" -- "$1"', "sh", p, str(max_bytes)], path,
                          output_limit=max(2, max_bytes)).stdout

  def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
    fsops.check_file_name(path)
    script = ('mkdir -p -- "$(dirname -- "$1")" && if [ -e "$1" ]; then ' + _REGULAR + 'fi; '
              'cat > "$1" && chmod "$2" "$1"')
    data = data.encode() if isinstance(data, str) else data
    self._file_cmd(["sh", "-c", script, "sh", _inside(path), f"{mode:o}"], path, stdin=data)

  def list_dir(self, path: str = ".") -> list[str]:
    out = self._file_cmd(["find", _inside(path), "-mindepth", "1", "-maxdepth", "1", "-printf", "%f\\0"], path,
                         output_limit=1 << 30).stdout
    return sorted(n.decode("utf-8", "surrogateescape") for n in out.split(b"\0") if n)

  def remove(self, path: str) -> None:
    p = _inside(path)
    if os.path.normpath(p) == WORKSPACE:
      raise SandboxError("refusing to remove the workspace root")
    if not self.exists(path):
      raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    self._file_cmd(["rm", "-rf", "--", p], path)

  def exists(self, path: str) -> bool:
    p = _inside(path)
    with self._lock:
      self._check_open()
      return self._launch(["sh", "-c", 'test -e "$1" || test -L "$1"', "sh", p], 60, None, {}).exit_code == 0
