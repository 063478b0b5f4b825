"""Ctrl-C as a request to stop at the next step boundary, so a training loop checkpoints what it has and exits.

A KeyboardInterrupt raised at an arbitrary point of a step can land between the state update and its bookkeeping
(the data iterator, the queue cursor, a half-written checkpoint). Inside `StopAtStep`, the first Ctrl-C only sets
`requested`; the loop checks it between steps, checkpoints the finished ones and raises `Interrupted`. A second
Ctrl-C raises KeyboardInterrupt at once (the user insists; a resume then starts from the last checkpoint).
"""
from __future__ import annotations

import signal
import sys
import threading


class Interrupted(KeyboardInterrupt):
  """A loop stopped by Ctrl-C after checkpointing; its message says where it stopped and how to resume."""


class StopAtStep:
  """While entered (in the main thread, and `enabled`; else it does nothing), Ctrl-C sets `requested` instead of
  raising."""

  def __init__(self, what: str, enabled: bool = True):
    self.what, self.enabled, self.requested, self._previous = what, enabled, False, None

  def __enter__(self):
    if self.enabled and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    print(f"\nCtrl-C: {self.what} stops after this step and checkpoints (Ctrl-C again to stop now)", file=sys.stderr,
          flush=True)

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
