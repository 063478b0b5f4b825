"""A pool that bounds how many sandboxes are alive (and running) at once."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from sandboxes.sandbox import Backend, Sandbox
from sandboxes.types import RunResult, SandboxConfig, Snapshot

T = TypeVar("T")


class SandboxPool:
  """At most `max_concurrency` forks exist at a time; extra work waits. Threads suffice: the work is subprocesses.

  Args:
    backend: makes the forks.
    max_concurrency: how many sandboxes may be alive at once (e.g. the number of cores for CPU-bound tests).
    config: `SandboxConfig` for the forks (default: the backend's).
  """

  def __init__(self, backend: Backend, max_concurrency: int, config: SandboxConfig | None = None):
    if max_concurrency < 1:
      raise ValueError(f"{max_concurrency=} must be >= 1")
    self.backend = backend
    self.max_concurrency = max_concurrency
    self.config = config
    self._slots = threading.BoundedSemaphore(max_concurrency)
    self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sandbox")

  @contextlib.contextmanager
  def lease(self, snapshot: Snapshot) -> Iterator[Sandbox]:
    """Blocks for a free slot, yields a fresh fork of `snapshot`, and closes it on exit."""
    with self._slots:
      sb = self.backend.fork(snapshot, self.config)
      try:
        yield sb
      finally:
        sb.close()

  def submit(self, snapshot: Snapshot, fn: Callable[[Sandbox], T]) -> Future[T]:
    """Runs `fn(sandbox)` on a fresh fork in a worker thread; the fork is closed afterwards."""

    def task() -> T:
      with self.lease(snapshot) as sb:
        return fn(sb)

    return self._executor.submit(task)

  def run_many(self, snapshot: Snapshot, cmds: Sequence[str], timeout: float = 60.0) -> list[RunResult]:
    """Runs each command in its own fork of `snapshot`, at most `max_concurrency` at once; results in order."""
    futures = [self.submit(snapshot, lambda sb, c=c: sb.run(c, timeout=timeout)) for c in cmds]
    return [f.result() for f in futures]

  def close(self) -> None:
    """Waits for submitted work to finish (the backend stays open)."""
    self._executor.shutdown(wait=True)

  def __enter__(self) -> SandboxPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
