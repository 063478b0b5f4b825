"""A `BwrapBackend` on a state root of its own, for sandbox tests that run commands as other host users."""
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
