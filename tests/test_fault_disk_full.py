"""Fault: the disk fills while a queue entry and a checkpoint are written (a real 8 MiB tmpfs filled to the brim).

Each write fails with one clear error; the last good checkpoint and every queued group stay readable; once space
is back a restored trainer goes on, and every group is applied exactly once. Mounting the tmpfs needs root; without
it the test runs itself again as root of a new user namespace (`unshare`), and is skipped only where that is
not allowed either."""
import contextlib
import errno
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from composer_jax.train import checkpoint as ckpt_lib
from rollout.queue import QueueConsumer, QueueProducer, QueueWriteError

IN_NAMESPACE = "COMPOSER_JAX_TEST_IN_USER_NAMESPACE"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _small_disk(path):
  path.mkdir()
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)], capture_output=True, text=True)
  if r.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], check=True)


def _run_as_namespace_root(request, tmp_path) -> None:
  """Without root, this test runs again as root of a new user and mount namespace, where a tmpfs may be mounted."""
  if shutil.which("unshare") is None:
    pytest.skip("mounting the small tmpfs needs root, or `unshare` (util-linux) for a user namespace")
  r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-m", "pytest", "-q",
                      "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inner'}", request.node.nodeid],
                     cwd=ROOT, env={**os.environ, IN_NAMESPACE: "1"}, capture_output=True, text=True, timeout=900)
  if r.returncode and "unshare:" in r.stderr:
    pytest.skip(f"mounting the small tmpfs needs root, and user namespaces are not available: {r.stderr.strip()}")
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _fill(path, leave_bytes):
  """Writes a filler file that leaves about `leave_bytes` free on the file system of `path`."""
  free = shutil.disk_usage(path).free
  with open(path / "filler", "wb") as f:
    f.write(b"\0" * max(0, free - leave_bytes))


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_disk_full_during_queue_append_and_checkpoint_loses_nothing(request, tmp_path):
  if os.geteuid() != 0 and not os.environ.get(IN_NAMESPACE):
    _run_as_namespace_root(request, tmp_path)
    return
  with _small_disk(tmp_path / "disk") as small_disk:
    _fill_and_recover(small_disk)


def _fill_and_recover(small_disk):
  url = f"file://{small_disk}/queue"
  rng = np.random.default_rng(0)
  producer = QueueProducer(url, "w0")
  for i in range(6):
    producer.append({"x": rng.random(512).astype(np.float32)}, {"i": i}, policy_version=0)
  ckpts = ckpt_lib.Checkpointer(str(small_disk / "run"), keep=2, async_save=False)
  consumer, applied = QueueConsumer(url), []

  def train_and_checkpoint(step, n, params):
    applied.extend(g.meta["i"] for g in consumer.poll(0, max_groups=n))
    qstate = consumer.state()
    ckpts.save(step, params, meta={"queue": qstate, "applied": list(applied)}, force=True)
    ckpts.wait()
    consumer.commit(qstate)

  params1 = {"w": jax.random.normal(jax.random.key(1), (256 * 1024,))}     # 1 MiB that does not compress
  train_and_checkpoint(1, 2, params1)
  _fill(small_disk, leave_bytes=64 * 1024)

  # A worker's next group (256 KiB) does not fit: a clear error, and nothing half-written is listed.
  big = {"x": rng.random(64 * 1024).astype(np.float32)}
  with pytest.raises(QueueWriteError, match="was not written: the disk is full; nothing of it is listed") as e:
    producer.append(big, {"i": 6}, policy_version=0)
  assert e.value.errno == errno.ENOSPC
  # The trainer's next checkpoint does not fit either: a clear error naming the intact one; the queue is not
  # committed past it, and the unfinished copy is gone (its space back).
  with pytest.raises(ckpt_lib.CheckpointDiskFullError, match=r"step 2 could not be written .* the disk is full .* "
                     r"last complete checkpoint is step 1 and it is intact"):
    train_and_checkpoint(2, 2, {"w": params1["w"] + 1})
  assert sorted(os.listdir(ckpts.directory)) == ["1"]
  ckpts.close()

  # The trainer dies; its restart finds step 1 and the queue readable: the groups consumed after step 1 come again.
  ckpts = ckpt_lib.Checkpointer(str(small_disk / "run"), keep=2, async_save=False)
  assert ckpts.latest_step() == 1
  np.testing.assert_array_equal(ckpts.restore(_abstract(params1))["w"], params1["w"])
  meta = ckpts.restore_meta()
  consumer, applied = QueueConsumer(url, state=meta["queue"]), meta["applied"]
  assert applied == [0, 1]

  # Space is back: the worker's redone group is queued, the trainer consumes everything and checkpoints.
  os.remove(small_disk / "filler")
  producer.append(big, {"i": 6}, policy_version=0)
  train_and_checkpoint(2, 5, {"w": params1["w"] + 1})
  ckpts.close()
  assert applied == list(range(7))                     # every group once: none lost, none applied twice
  again = ckpt_lib.Checkpointer(str(small_disk / "run"), keep=2, async_save=False)
  assert again.latest_step() == 2 and again.restore_meta()["applied"] == list(range(7))
  again.close()
