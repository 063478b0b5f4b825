"""Kernel budgets that namespaces do not split: one fork exhausting one must leave the host and other forks alone.

Each test lets fork A take all it can of a budget and hold it (the command marks the workspace when it is done,
then sleeps until the test closes the fork), and meanwhile checks the host or fork B. Found by an attack run
through the public API (each test failed before its fix): the system-wide AIO budget (`fs.aio-max-nr`), the pty
budget of non-host devpts instances (`kernel.pty.max` - reserve), and the per-uid POSIX message queue budget.
"""

import contextlib
import ctypes
import errno
import os
import threading
import time

import pytest

from sandboxes import Limits, SandboxConfig
from tests.sandbox_testlib import ROOT_ONLY, bwrap_backend

pytestmark = ROOT_ONLY


@pytest.fixture(scope="module")
def backend():
  with bwrap_backend("sbx_budgets_") as be:
    yield be


@contextlib.contextmanager
def holding(backend, base, script: str, config: SandboxConfig | None = None):
  """Runs the Python `script` in a fork in the background; yields what it wrote to /workspace/ready once there.

  The script writes that file when it holds what it took, then sleeps; leaving the block closes the fork, which
  kills it.
  """
  sb = backend.create(str(base), config)
  result = {}
  t = threading.Thread(target=lambda: result.update(r=sb.run(["python3", "-c", script], timeout=120)))
  t.start()
  ready = os.path.join(sb.merged, "ready")
  try:
    deadline = time.monotonic() + 90
    while not os.path.exists(ready):
      assert t.is_alive(), (result["r"], result["r"].stderr_text)
      assert time.monotonic() < deadline, "the holder never got ready"
      time.sleep(0.05)
    time.sleep(0.05)  # the file is written in one call, but give the write a moment to land
    with open(ready) as f:
      yield f.read()
  finally:
    sb.close()
    t.join()


def _nr(name: str) -> int:
  import pyseccomp

  return pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)


HOLD = """
open("/workspace/ready", "w").write(REPORT)
import time
time.sleep(600)
"""

# -- 1. AIO --------------------------------------------------------------------------------------------------
AIO_TAKE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
taken, err = 0, 0
for n in (32768, 4096, 512, 64, 8, 1):  # io_setup(n) reserves about n of the system-wide fs.aio-max-nr
  while True:
    ctx = ctypes.c_ulong(0)
    if libc.syscall(NR, n, ctypes.byref(ctx)) != 0:
      err = ctypes.get_errno()
      break
    taken += n
REPORT = f"{taken} {err}"
"""


def _host_io_setup() -> int:
  """errno of one io_setup(1) by the test process itself (0: it worked; the context is destroyed again)."""
  libc = ctypes.CDLL(None, use_errno=True)
  ctx = ctypes.c_ulong(0)
  if libc.syscall(_nr("io_setup"), 1, ctypes.byref(ctx)) != 0:
    return ctypes.get_errno()
  libc.syscall(_nr("io_destroy"), ctx)
  return 0


def test_a_fork_cannot_take_the_hosts_aio_budget(backend, tmp_path):
  assert _host_io_setup() == 0  # the host can use AIO at all
  with holding(backend, tmp_path, f"NR = {_nr('io_setup')}\n" + AIO_TAKE + HOLD) as report:
    taken, err = map(int, report.split())
    assert _host_io_setup() == 0, f"the fork took {taken} AIO events and the host's io_setup fails"
  assert (taken, err) == (0, errno.ENOSYS)  # AIO does not exist inside, as on a kernel built without it


# -- 2. ptys -------------------------------------------------------------------------------------------------
PTY_TAKE = """
import os
# RLIMIT_NOFILE caps one process's ptys, so four processes take them (one master fd holds a pty).
pipes = []
for _ in range(4):
  r, w = os.pipe()
  if os.fork() == 0:
    n = 0
    try:
      while True:
        os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
        n += 1
    except OSError:
      pass
    os.write(w, f"{n}\\n".encode())
    import time
    time.sleep(600)  # keeps the ptys
  pipes.append(r)
REPORT = str(sum(int(os.read(r, 100)) for r in pipes))
"""

PTY_ONE = "import pty; pty.openpty(); print('ok')"


def test_a_fork_cannot_take_every_pty(backend, tmp_path):
  with holding(backend, tmp_path, PTY_TAKE + HOLD) as report:
    with backend.create(str(tmp_path)) as b:
      r = b.run(["python3", "-c", PTY_ONE])
    assert r.ok and r.stdout_text == "ok\n", f"after fork A took {report} ptys: {r.stderr_text}"
  assert int(report) == Limits().ptys  # all a fork may have


def test_pty_limit_is_per_fork_and_configurable(backend, tmp_path):
  cfg = SandboxConfig(limits=Limits(ptys=3))
  with backend.create(str(tmp_path), cfg) as sb:
    r = sb.run(["python3", "-c", "import pty\nfor i in range(4):\n  pty.openpty(); print(i)"])
    assert r.stdout_text.split() == ["0", "1", "2"] and "out of pty devices" in r.stderr_text, r
    assert sb.run(["python3", "-c", PTY_ONE]).ok  # a run's ptys go with it
    assert sb.run("script -qc 'tty' /dev/null").stdout_text.startswith("/dev/pts/")  # a terminal program works
  with pytest.raises(ValueError, match="Limits.ptys"):
    Limits(ptys=0)


# -- 3. POSIX message queues ---------------------------------------------------------------------------------
MQ_OPEN = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def mq(name):
  fd = libc.mq_open(name.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
  return 0 if fd >= 0 else ctypes.get_errno()
"""
MQ_TAKE = MQ_OPEN + """
n, err = 0, 0
while n < 1000:
  err = mq(f"/q{n}")
  if err:
    break
  n += 1
REPORT = f"{n} {err}"
"""


def test_message_queues_are_no_channel_between_forks(backend, tmp_path):
  probe = ["python3", "-c", MQ_OPEN + "print(mq('/b'))"]
  with backend.create(str(tmp_path)) as b:
    alone = b.run(probe).stdout_text
    with holding(backend, tmp_path, MQ_TAKE + HOLD) as report:
      beside = b.run(probe).stdout_text
  assert beside == alone, f"fork B's mq_open gave {alone!r} alone, {beside!r} while fork A held {report}"
  assert alone == f"{errno.ENOSYS}\n" and report == f"0 {errno.ENOSYS}"  # no queues at all, as without the option
