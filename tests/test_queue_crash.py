"""Queue atomicity and exactly-once delivery under real SIGKILLs of producer and consumer processes.

Each test runs on a file:// store and on S3 (a real moto server on 127.0.0.1, started by `s3_testlib`).
"""
import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from s3_testlib import queue_store, s3_endpoint  # noqa: F401  (s3_endpoint: a fixture)

from rollout.queue import QueueConsumer, QueueProducer
from rollout.staleness import StalenessConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

PRODUCER = textwrap.dedent("""
  import hashlib, sys
  import numpy as np
  from rollout.queue import QueueProducer
  url, pid, start, mb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
  p = QueueProducer(url, pid)
  rng = np.random.default_rng(start)
  for i in range(start, start + 1000):
    payload = rng.integers(0, 255, mb << 20, dtype=np.uint8)   # stored as is (already uint8)
    print(f"writing {i}", flush=True)
    p.append({"payload": payload}, {"i": i, "sha": hashlib.sha256(payload.tobytes()).hexdigest()},
             policy_version=0)
    print(i, flush=True)
""")

# A stand-in trainer: its "parameters" are the list of applied group ids; it checkpoints them with the queue
# position through orbax every `every` groups, then garbage-collects; it can SIGKILL itself right after applying
# a group (consumed, not yet checkpointed).
CONSUMER = textwrap.dedent("""
  import os, signal, sys
  import orbax.checkpoint as ocp
  from rollout.queue import QueueConsumer
  url, ckpt, crash_after, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
  mgr = ocp.CheckpointManager(ckpt, item_names=("train", "queue"))
  applied, qstate = [], None
  if mgr.latest_step() is not None:
    r = mgr.restore(mgr.latest_step(), args=ocp.args.Composite(train=ocp.args.JsonRestore(),
                                                               queue=ocp.args.JsonRestore()))
    applied, qstate = r["train"]["applied"], r["queue"]
  consumer = QueueConsumer(url, state=qstate)
  n_here = 0
  with open(os.path.join(ckpt, "..", "delivered.log"), "a") as log:
    while True:
      groups = consumer.poll(0, max_groups=1)
      if not groups:
        break
      applied.append(groups[0].meta["i"])
      log.write(f"{groups[0].meta['i']}\\n"); log.flush(); os.fsync(log.fileno())
      n_here += 1
      if n_here == crash_after:
        os.kill(os.getpid(), signal.SIGKILL)
      if len(applied) % every == 0:
        state = consumer.state()
        mgr.save(len(applied), args=ocp.args.Composite(train=ocp.args.JsonSave({"applied": applied}),
                                                      queue=ocp.args.JsonSave(state)))
        mgr.wait_until_finished()
        consumer.commit(state)
  state = consumer.state()
  mgr.save(len(applied), args=ocp.args.Composite(train=ocp.args.JsonSave({"applied": applied}),
                                                queue=ocp.args.JsonSave(state)), force=True)
  mgr.wait_until_finished()
  consumer.commit(state)
  print("done", len(applied))
""")


def _env():
  return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
  """(KvStore, the string spec the test's subprocesses open) on each backend."""
  return queue_store(request.param, tmp_path, request)


def _group_names(kv, producer):
  return {k.decode().rsplit("/", 1)[1] for k in kv.list().result() if k.startswith(f"groups/{producer}/".encode())}


def _read_all(url):
  c = QueueConsumer(url)
  out = []
  while groups := c.poll(0):
    for g in groups:
      assert hashlib.sha256(g.arrays["payload"].tobytes()).hexdigest() == g.meta["sha"]
      out.append(g.meta["i"])
  return out


def test_producer_killed_mid_write_leaves_nothing_half_readable(store, tmp_path):
  """SIGKILL while a 24 MB group is being written: nothing partial is listed, the next producer continues.

  "Mid-write" is observed per backend: on file:// the driver's `<key>.__lock` temporary exists; on S3 the producer
  has announced the write and its key is still absent after the kill (the PUT never completed; a 24 MB PUT to the
  local server takes ~0.7 s, the kill comes 0.05 s after the announcement).
  """
  kv, url = store
  is_file = url.startswith("file://")
  gdir = tmp_path / "q" / "groups" / "w0"
  start, partials = 0, 0
  for _ in range(2):
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, url, "w0", str(start), "24"], env=_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == f"writing {start}"
    assert proc.stdout.readline().strip() == str(start)        # one group is visible ...
    assert proc.stdout.readline().strip() == f"writing {start + 1}"
    before = _group_names(kv, "w0")
    if is_file:
      deadline = time.time() + 60
      while not (gdir.exists() and any(f.name.endswith(".__lock") for f in gdir.iterdir())):
        assert time.time() < deadline, "producer never started a second write"
        time.sleep(0.001)
    else:
      time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)                            # ... and the next one is being written
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    if is_file:
      partials += any(f.name.endswith(".__lock") for f in gdir.iterdir())
    else:
      partials += _group_names(kv, "w0") == before
    got = _read_all(url)                                        # every listed record decodes and its hash matches
    assert got == list(range(len(got))) and len(got) >= start + 1
    start = len(got)                                            # the restarted producer continues the numbering
  assert partials >= 1                                          # the kill really interrupted a write
  # A restarted producer's groups sort after the killed one's: one more append and read back in order.
  QueueProducer(url, "w0").append({"payload": np.zeros(3, np.uint8)},
                                  {"i": start, "sha": hashlib.sha256(bytes(3)).hexdigest()}, policy_version=0)
  assert _read_all(url) == list(range(start + 1))


def test_consumer_killed_between_consume_and_checkpoint_is_exactly_once(store, tmp_path):
  kv, url = store
  n = 14
  p = QueueProducer(url, "w0")
  q = QueueProducer(url, "w1")
  for i in range(n):
    (p if i % 3 else q).append({"payload": np.full(8, i, np.uint8)}, {"i": i}, policy_version=0)
  ckpt = tmp_path / "ckpt"
  runs = []
  for crash_after in (5, 4, -1):     # crash after consuming 5 (ckpt at 3), then 4 more past the restore, then finish
    r = subprocess.run([sys.executable, "-c", CONSUMER, url, str(ckpt), str(crash_after), "3"], env=_env(),
                       capture_output=True, text=True, timeout=300)
    runs.append(r.returncode)
    assert r.returncode in (-signal.SIGKILL, 0), r.stderr[-2000:]
  assert runs == [-signal.SIGKILL, -signal.SIGKILL, 0]
  delivered = [int(x) for x in (tmp_path / "delivered.log").read_text().split()]
  # Groups consumed after the last checkpoint were delivered again after the crash (never applied) ...
  assert delivered == [0, 1, 2, 3, 4] + [3, 4, 5, 6] + list(range(6, n))
  # ... and the final trainer state has applied every group exactly once, in order.
  import orbax.checkpoint as ocp
  mgr = ocp.CheckpointManager(ckpt, item_names=("train", "queue"))
  final = mgr.restore(mgr.latest_step(), args=ocp.args.Composite(train=ocp.args.JsonRestore(),
                                                                 queue=ocp.args.JsonRestore()))
  assert final["train"]["applied"] == list(range(n))
  assert final["queue"]["consumed"] == n
  # Everything consumed has been garbage-collected.
  assert not _group_names(kv, "w0") and not _group_names(kv, "w1")


SMALL_PRODUCER = textwrap.dedent("""
  import sys
  import numpy as np
  from rollout.queue import QueueProducer
  url, pid, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
  p = QueueProducer(url, pid)
  for i in range(n):
    p.append({"x": np.full(16, i, np.int32)}, {"pid": pid, "i": i}, policy_version=i)
""")


def test_concurrent_producer_processes_while_consuming(store):
  """Three producer processes append while the consumer polls: all groups once, each producer's in order."""
  _, url = store
  n = 25
  procs = [subprocess.Popen([sys.executable, "-c", SMALL_PRODUCER, url, f"w{j}", str(n)], env=_env())
           for j in range(3)]
  c = QueueConsumer(url, StalenessConfig(max_staleness=n))     # versions 0..n-1 at trainer version n: all used
  got = []
  deadline = time.time() + 120
  while len(got) < 3 * n:
    assert time.time() < deadline, f"only {len(got)} groups arrived"
    batch = c.poll(n, max_groups=7)
    got += [(g.meta["pid"], g.meta["i"]) for g in batch]
    for g in batch:
      np.testing.assert_array_equal(g.arrays["x"], np.full(16, g.meta["i"], np.int32))
    if not batch:
      time.sleep(0.01)
  assert all(p.wait(timeout=60) == 0 for p in procs)
  assert c.poll(n) == []
  for j in range(3):
    assert [i for pid, i in got if pid == f"w{j}"] == list(range(n))
  assert c.stats()["consumed_groups"] == 3 * n
