"""Argument checks for `Sandbox.run`, done before anything is launched.

Without them a malformed argument comes back as exit code 1 with a message from bwrap or the kernel (or an
OSError naming the wrong program), indistinguishable from a failing command.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

# The kernel's cap on one argv/env string (MAX_ARG_STRLEN, 32 pages) and on all of them (ARG_MAX).
MAX_ARG_STRLEN = 32 * 4096
ARG_MAX = os.sysconf("SC_ARG_MAX") if hasattr(os, "sysconf") else 1 << 21


def shell_argv(cmd: str | Sequence[str]) -> list[str]:
  """`cmd` as an argv: a string runs under `bash -c` (`sh -c` where bash is missing)."""
  if isinstance(cmd, str):
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    return [shell, "-c", cmd]
  if isinstance(cmd, bytes) or not isinstance(cmd, Sequence):
    raise TypeError(f"cmd must be a shell string or a non-empty list of strings, got {type(cmd).__name__}")
  argv = list(cmd)
  if not argv:
    raise ValueError("cmd must be a shell string or a non-empty list of strings, got an empty list")
  for i, a in enumerate(argv):
    if not isinstance(a, str):
      raise TypeError(f"cmd must be a shell string or a non-empty list of strings; cmd[{i}] is {type(a).__name__}")
  return argv


def _string(what: str, s: str) -> None:
  if "\0" in s:
    raise ValueError(f"{what} contains a NUL byte")
  if len(s.encode("utf-8", "surrogateescape")) >= MAX_ARG_STRLEN:
    raise ValueError(f"{what} is {len(s)} characters; the kernel passes at most {MAX_ARG_STRLEN - 1} bytes per "
                     "argument or variable (give big data as stdin or a file)")


def env_vars(env: Mapping[str, str], what: str = "env") -> None:
  if not isinstance(env, Mapping):
    raise TypeError(f"{what} must be a mapping of str to str, got {type(env).__name__}")
  for k, v in env.items():
    if not isinstance(k, str) or not isinstance(v, str):
      raise TypeError(f"{what} keys and values must be str, got {k!r}: {type(v).__name__}")
    if not k or "=" in k or "\0" in k:
      raise ValueError(f"{what} key {k!r} is not a variable name (empty, or contains '=' or NUL)")
    _string(f"{what}[{k!r}]", v)


def run_args(cmd: str | Sequence[str], timeout: float, stdin: bytes | None,
             env: Mapping[str, str] | None) -> list[str]:
  """Checks `Sandbox.run`'s arguments and returns the argv to run.

  Raises:
    TypeError / ValueError: naming the argument that is wrong.
  """
  if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
    raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
  if stdin is not None and not isinstance(stdin, bytes | bytearray | memoryview):
    raise TypeError(f"stdin must be bytes or None (encode text first), got {type(stdin).__name__}")
  argv = shell_argv(cmd)
  for i, a in enumerate(argv):
    _string(f"cmd[{i}]" if not isinstance(cmd, str) else "cmd", a)
  if env is not None:
    env_vars(env)
  return argv


def total_size(argv: Sequence[str], max_args: int | None = None, what: str = "the command line") -> None:
  """Raises if a full command line (launcher + options + command) exceeds the kernel's or a program's limits."""
  if max_args is not None and len(argv) > max_args:
    raise ValueError(f"{what} has {len(argv)} arguments, over the limit of {max_args} (the command itself may "
                     f"have about {max_args - 200}); pass long lists through stdin or a file")
  size = sum(len(a.encode("utf-8", "surrogateescape")) + 1 + 8 for a in argv)  # + NUL + the pointer
  if size > ARG_MAX - 4096:
    raise ValueError(f"{what} is {size} bytes, over the kernel's ARG_MAX of {ARG_MAX}; pass big data through "
                     "stdin or a file")
