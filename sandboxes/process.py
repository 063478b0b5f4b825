"""Run one host process with a wall-clock timeout, size-capped output capture and a kill hook."""

from __future__ import annotations

import dataclasses
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Sequence

from sandboxes.types import RunResult


class CappedBuffer:
  """Keeps the first and last `limit // 2` bytes of a stream and counts what it drops."""

  def __init__(self, limit: int):
    self.head_limit = limit // 2
    self.tail_limit = limit - self.head_limit
    self.head = bytearray()
    self.tail = bytearray()
    self.total = 0

  def feed(self, data: bytes) -> None:
    self.total += len(data)
    room = self.head_limit - len(self.head)
    if room > 0:
      self.head += data[:room]
      data = data[room:]
    if data:
      self.tail += data
      # Trim lazily (amortised O(1) per byte) rather than on every chunk.
      if len(self.tail) > 2 * self.tail_limit:
        del self.tail[: len(self.tail) - self.tail_limit]

  @property
  def truncated(self) -> bool:
    return self.total > self.head_limit + self.tail_limit

  def value(self) -> bytes:
    return bytes(self.head) + bytes(self.tail[max(0, len(self.tail) - self.tail_limit) :])


@dataclasses.dataclass(frozen=True)
class ProcessOutcome:
  """What `run_process` saw: the command's `RunResult` (exit code in shell convention, None if we killed it; no
  limit attributed yet, `sandbox.result_from` does that) and why we killed it."""
  result: RunResult
  kill_reason: str | None  # "timeout" or what `poll` returned


class _Pipes:
  """The child's stdout and stderr read, and its stdin fed, from one non-blocking loop.

  Fed from the same loop as the reads, so a command that ignores its stdin (or floods its output) cannot block
  us. A pidfd (Linux >= 5.3) is watched too, so the loop wakes the moment the process exits instead of at the
  next poll tick.
  """

  def __init__(self, proc: subprocess.Popen, stdin: bytes | None, output_limit: int):
    self.proc = proc
    self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    self.bufs = {self.out_fd: CappedBuffer(output_limit), self.err_fd: CappedBuffer(output_limit)}
    self.sel = selectors.DefaultSelector()
    for fd in (self.out_fd, self.err_fd):
      os.set_blocking(fd, False)
      self.sel.register(fd, selectors.EVENT_READ)
    self.pending = memoryview(stdin or b"")
    if stdin is not None:
      os.set_blocking(proc.stdin.fileno(), False)
      if self.pending:
        self.sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
      else:
        proc.stdin.close()
    try:
      self.pidfd = os.pidfd_open(proc.pid)
      self.sel.register(self.pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):  # not Linux, or an old kernel: fall back to proc.wait with a timeout
      self.pidfd = None

  @property
  def open(self) -> bool:
    """Whether an output pipe (or stdin) is still being served."""
    return any(key.fd != self.pidfd for key in self.sel.get_map().values())

  def pump(self, wait: float) -> None:
    """Serves whatever is ready within `wait` seconds (returns early when the process exits)."""
    for key, _ in self.sel.select(wait):
      if key.fd == self.pidfd:
        continue  # exited: the caller's proc.poll() reaps it
      if key.events & selectors.EVENT_WRITE:
        self._feed(key.fd)
        continue
      try:
        data = os.read(key.fd, 1 << 16)
      except BlockingIOError:
        continue
      if data:
        self.bufs[key.fd].feed(data)
      else:
        self.sel.unregister(key.fd)

  def _feed(self, fd: int) -> None:
    try:
      self.pending = self.pending[os.write(fd, self.pending[: 1 << 16]):]
    except BlockingIOError:
      return
    except BrokenPipeError:
      self.pending = self.pending[:0]
    if not self.pending:
      self.sel.unregister(fd)
      self.proc.stdin.close()

  def wait_exit(self, wait: float) -> None:
    """Output is closed: wait (at most `wait` s) for the exit itself."""
    if self.pidfd is not None:
      self.sel.select(wait)
      return
    try:
      self.proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
      pass

  def drain(self, timeout: float) -> None:
    """Reads what backgrounded children (now killed) left in the pipes, for at most `timeout` seconds."""
    if self.pidfd is not None:
      self.sel.unregister(self.pidfd)
      os.close(self.pidfd)
      self.pidfd = None
    end = time.monotonic() + timeout
    while self.open and time.monotonic() < end:
      self.pump(max(0.0, end - time.monotonic()))

  def close(self) -> None:
    if self.pidfd is not None:
      os.close(self.pidfd)
    self.sel.close()
    for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
      if f is not None and not f.closed:
        f.close()


def _supervise(proc: subprocess.Popen, pipes: _Pipes, deadline: float, kill: Callable[[subprocess.Popen], None],
               poll: Callable[[], str | None] | None, poll_interval: float) -> str | None:
  """Serves the pipes until the process exits or must be killed; returns why it was killed (None: it exited)."""
  next_poll = time.monotonic() + poll_interval
  while proc.poll() is None:
    now = time.monotonic()
    reason = "timeout" if now >= deadline else None
    if now >= next_poll:
      if reason is None and poll is not None:
        reason = poll()
      next_poll = now + poll_interval
    if reason is not None:
      kill(proc)
      proc.wait()
      return reason
    wait = max(0.0, min(deadline, next_poll) - now)
    if pipes.open:
      pipes.pump(wait)
    else:
      pipes.wait_exit(wait)
  return None


def run_process(
  argv: Sequence[str],
  *,
  timeout: float,
  output_limit: int,
  kill: Callable[[subprocess.Popen], None],
  poll: Callable[[], str | None] | None = None,
  poll_interval: float = 0.05,
  stdin: bytes | None = None,
  drain_timeout: float = 0.5,
  **popen_kw,
) -> ProcessOutcome:
  """Runs `argv`, capturing output, and kills it via `kill(proc)` on timeout or when `poll()` names a reason.

  `kill` is also called once after a normal exit, so that backgrounded children of the command die and release
  the output pipes; the pipes are then drained for at most `drain_timeout` seconds.
  """
  t0 = time.monotonic()
  proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen_kw)
  pipes = _Pipes(proc, stdin, output_limit)
  try:
    kill_reason = _supervise(proc, pipes, t0 + timeout, kill, poll, poll_interval)
    wall_s = time.monotonic() - t0
    kill(proc)  # reap anything the command left behind before draining the pipes
    pipes.drain(drain_timeout)
  finally:
    if proc.poll() is None:
      kill(proc)
      proc.wait()
    pipes.close()
  out, err = pipes.bufs[pipes.out_fd], pipes.bufs[pipes.err_fd]
  rc = None if kill_reason is not None else proc.returncode
  if rc is not None and rc < 0:   # subprocess reports a signal N as -N, a shell (and bwrap) as 128+N
    rc = 128 - rc
  return ProcessOutcome(RunResult(exit_code=rc, stdout=out.value(), stderr=err.value(),
                                  stdout_truncated=out.truncated, stderr_truncated=err.truncated, wall_s=wall_s,
                                  timed_out=kill_reason == "timeout"), kill_reason)
