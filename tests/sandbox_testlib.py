"""Sandbox test helpers: a `BwrapBackend` on a state root of its own (for tests that run commands as other host
users), and the host's processes found by their command line."""
import contextlib
import os
import shutil
import tempfile

from sandboxes import BwrapBackend


@contextlib.contextmanager
def bwrap_backend(prefix: str, **kwargs):
  """A backend whose state root (in /dev/shm where there is one) the unprivileged sandbox uid can traverse; kwargs
  go to `BwrapBackend`."""
  d = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
  os.chmod(d, 0o711)
  try:
    with BwrapBackend(state_root=d, **kwargs) as be:
      yield be
  finally:
    shutil.rmtree(d, ignore_errors=True)


def host_procs_with(marker: str) -> list[int]:
  """Host pids whose command line contains `marker` (independent of the sandbox's own bookkeeping)."""
  out = []
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          if marker.encode() in f.read():
            out.append(int(pid))
      except OSError:
        pass
  return out
