"""SandboxPool: concurrency is bounded, results come back in order, forks are closed."""

import os
import threading
import time

import pytest

from sandboxes import SandboxPool
from tests.sandbox_testlib import ROOT_ONLY, backend_fixture

pytestmark = ROOT_ONLY


backend = backend_fixture()


def test_pool_bounds_concurrency_and_isolates_forks(backend, tmp_path):
  (tmp_path / "n.txt").write_text("0\n")
  snap = backend.import_dir(str(tmp_path))
  live, peak, lock = [0], [0], threading.Lock()
  seen_dirs = []

  def job(sb, i):
    with lock:
      live[0] += 1
      peak[0] = max(peak[0], live[0])
      seen_dirs.append(sb.dir)
    try:
      r = sb.run(f"sleep 0.2; echo {i} >> n.txt; cat n.txt")
      return r.stdout_text.split()
    finally:
      with lock:
        live[0] -= 1

  with SandboxPool(backend, max_concurrency=2) as pool:
    futures = [pool.submit(snap, lambda sb, i=i: job(sb, i)) for i in range(6)]
    results = [f.result() for f in futures]
  assert peak[0] == 2
  assert results == [["0", str(i)] for i in range(6)]  # each fork saw only the snapshot plus its own write
  assert not any(os.path.exists(d) for d in seen_dirs)  # every fork was closed


def test_run_many_in_order_and_lease_blocks(backend, tmp_path):
  snap = backend.import_dir(str(tmp_path))
  with SandboxPool(backend, max_concurrency=1) as pool:
    rs = pool.run_many(snap, [f"echo {i}" for i in range(4)])
    assert [r.stdout for r in rs] == [f"{i}\n".encode() for i in range(4)]
    with pool.lease(snap) as sb:
      t0 = time.monotonic()
      fut = pool.submit(snap, lambda s: time.monotonic())
      time.sleep(0.3)
      assert not fut.done()  # the only slot is held by the lease
      assert sb.run("true").ok
    assert fut.result() - t0 >= 0.3


def test_pool_rejects_bad_size(backend):
  with pytest.raises(ValueError, match="max_concurrency=0 must be >= 1"):
    SandboxPool(backend, max_concurrency=0)
