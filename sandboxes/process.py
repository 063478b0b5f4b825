"""Run one host process with a wall-clock timeout, size-capped output capture and a kill hook."""

from __future__ import annotations

import dataclasses
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Sequence


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
  returncode: int | None  # None if we killed it
  stdout: bytes
  stderr: bytes
  stdout_truncated: bool
  stderr_truncated: bool
  wall_s: float
  timed_out: bool
  kill_reason: str | None  # "timeout" or what `poll` returned


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
  proc = subprocess.Popen(
    argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
    stderr=subprocess.PIPE, **popen_kw)
  bufs = {proc.stdout.fileno(): CappedBuffer(output_limit), proc.stderr.fileno(): CappedBuffer(output_limit)}
  out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
  sel = selectors.DefaultSelector()
  for f in (proc.stdout, proc.stderr):
    os.set_blocking(f.fileno(), False)
    sel.register(f.fileno(), selectors.EVENT_READ)
  pending = memoryview(stdin or b"")
  if stdin is not None:  # fed from the same loop as the reads, so a command that ignores stdin cannot block us
    in_fd = proc.stdin.fileno()
    os.set_blocking(in_fd, False)
    if pending:
      sel.register(in_fd, selectors.EVENT_WRITE)
    else:
      proc.stdin.close()

  def pump(wait: float) -> None:
    nonlocal pending
    for key, _ in sel.select(wait):
      if key.events & selectors.EVENT_WRITE:
        try:
          pending = pending[os.write(key.fd, pending[: 1 << 16]):]
        except BlockingIOError:
          continue
        except BrokenPipeError:
          pending = pending[:0]
        if not pending:
          sel.unregister(key.fd)
          proc.stdin.close()
        continue
      try:
        data = os.read(key.fd, 1 << 16)
      except BlockingIOError:
        continue
      if data:
        bufs[key.fd].feed(data)
      else:
        sel.unregister(key.fd)

  kill_reason = None
  deadline = t0 + timeout
  next_poll = t0 + poll_interval
  try:
    while proc.poll() is None:
      now = time.monotonic()
      if now >= deadline:
        kill_reason = "timeout"
      elif poll is not None and now >= next_poll:
        kill_reason = poll()
        next_poll = now + poll_interval
      if kill_reason is not None:
        kill(proc)
        proc.wait()
        break
      wait = max(0.0, min(deadline - now, next_poll - now if poll is not None else poll_interval, poll_interval))
      if sel.get_map():
        pump(wait)
      else:  # output closed; wait for the exit itself (subprocess backs off from 0.5 ms, so short exits are quick)
        try:
          proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
          pass
    wall_s = time.monotonic() - t0
    kill(proc)  # reap anything the command left behind before draining the pipes
    drain_end = time.monotonic() + drain_timeout
    while sel.get_map() and time.monotonic() < drain_end:
      pump(max(0.0, drain_end - time.monotonic()))
  finally:
    if proc.poll() is None:
      kill(proc)
      proc.wait()
    sel.close()
    if proc.stdin is not None and not proc.stdin.closed:
      proc.stdin.close()
    proc.stdout.close()
    proc.stderr.close()
  return ProcessOutcome(
    returncode=None if kill_reason is not None else proc.returncode,
    stdout=bufs[out_fd].value(), stderr=bufs[err_fd].value(),
    stdout_truncated=bufs[out_fd].truncated, stderr_truncated=bufs[err_fd].truncated,
    wall_s=wall_s, timed_out=kill_reason == "timeout", kill_reason=kill_reason)
