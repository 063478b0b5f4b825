"""Isolated execution of untrusted commands with snapshot/fork of workspaces. See sandboxes/README.md.

  with sandboxes.BwrapBackend() as backend:
    snap = backend.import_dir("/path/to/repo")
    with backend.fork(snap) as sb:
      r = sb.run("python -m pytest -q", timeout=60)
"""

from sandboxes.bwrap_backend import BwrapBackend
from sandboxes.local import UnsafeLocalBackend
from sandboxes.pool import SandboxPool
from sandboxes.sandbox import Backend, Sandbox
from sandboxes.store import cleanup
from sandboxes.types import (
  WORKSPACE,
  BackendUnavailableError,
  Limits,
  RunResult,
  SandboxClosedError,
  SandboxConfig,
  SandboxError,
  Snapshot,
)

BACKENDS = {"bwrap": BwrapBackend, "unsafe-local": UnsafeLocalBackend}


def make_backend(name: str = "bwrap", **kwargs) -> Backend:
  """Backend by name: "bwrap" (default, isolated) or "unsafe-local" (no isolation; must be asked for by name).

  Raises:
    ValueError: unknown name (the message lists the valid ones).
    BackendUnavailableError: "bwrap" cannot run here; there is deliberately no silent fallback.
  """
  if name not in BACKENDS:
    raise ValueError(f"unknown sandbox backend {name!r}; valid: {sorted(BACKENDS)}")
  return BACKENDS[name](**kwargs)


__all__ = [
  "BACKENDS", "WORKSPACE", "Backend", "BackendUnavailableError", "BwrapBackend", "Limits", "RunResult", "Sandbox",
  "SandboxClosedError", "SandboxConfig", "SandboxError", "SandboxPool", "Snapshot", "UnsafeLocalBackend", "cleanup",
  "make_backend",
]
