"""Sandbox test helpers: the root-only mark, a module's `BwrapBackend` fixture, a backend on a state root of its
own (for tests that run commands as other host users), a sandbox over a one-file workspace, and the host's
processes found by their command line."""
import contextlib
import os
import shutil
import tempfile

import pytest

from sandboxes import BwrapBackend

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="BwrapBackend needs root (overlay mounts, cgroups)")


def backend_fixture(**kwargs):
  """A module-scoped pytest fixture: one `BwrapBackend(**kwargs)` shared by the module's tests, closed after them."""

  @pytest.fixture(scope="module")
  def backend():
    with BwrapBackend(**kwargs) as be:
      yield be

  return backend


@contextlib.contextmanager
def sandbox_with_file(backend, tmp_path):
  """A sandbox of `backend` over `tmp_path` holding f.txt ("content\n")."""
  (tmp_path / "f.txt").write_text("content\n")
  with backend.create(str(tmp_path)) as s:
    yield s


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
