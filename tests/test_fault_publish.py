"""Fault: the trainer dies during a publish (a real SIGKILL while the weight file is half written), or after a
publish but before that step's checkpoint. Workers keep serving the last whole version and never load a
half-written file; after the restart each version is published once, and a worker that had loaded a withdrawn
version goes back to the checkpoint's."""
import os
import signal
import subprocess
import sys
import types

import numpy as np

from composer_jax.rl import publishers, weight_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIKE = {"w": np.zeros(1000, np.float32)}

# A trainer that publishes v0 and v1, then is killed while v2's file is half written (savez blocks halfway).
_TRAINER = """
import sys, time
import numpy as np
from composer_jax.rl import weight_files
d = sys.argv[1]
for v in (0, 1):
  weight_files.publish(d, {"w": np.full(1000, v, np.float32)}, v)
def half_then_hang(path, **arrays):
  with open(path, "wb") as f:
    f.write(b"PK\\x03\\x04 half of a zip")
  print("writing", flush=True)
  time.sleep(600)
weight_files.np.savez = half_then_hang
weight_files.publish(d, {"w": np.full(1000, 2, np.float32)}, 2)
"""


class _Engine:
  """Stands in for a worker's JaxEngine: records every version it loads."""

  def __init__(self, params, version):
    self.params, self.policy_version, self.loaded = params, version, []

  def update_weights(self, params, policy_version):
    self.params, self.policy_version = params, policy_version
    self.loaded.append(policy_version)


def _worker(wdir):
  version, path = weight_files.latest(wdir)
  engine = _Engine(weight_files.load(path, LIKE), version)
  return engine, publishers.follow_pointer(wdir, LIKE, engine)


def _params(x):
  return {"w": np.full(1000, x, np.float32)}


def test_trainer_killed_mid_publish_workers_keep_the_last_version_and_it_is_published_once(tmp_path):
  wdir = str(tmp_path / "weights")
  proc = subprocess.Popen([sys.executable, "-c", _TRAINER, wdir], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
  try:
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait()
  assert any(".tmp" in n for n in os.listdir(wdir))                  # the half-written file is there ...
  assert weight_files.latest(wdir)[0] == 1                                # ... but the pointer names v1, whole
  engine, load_newer = _worker(wdir)
  load_newer()
  assert engine.policy_version == 1 and engine.loaded == [] and float(engine.params["w"][0]) == 1.0

  # Restart from the checkpoint at step 1: the leftover goes, v1 is not published again, step 2 publishes v2.
  stamp = os.stat(os.path.join(wdir, "v1.npz")).st_mtime_ns
  pub = publishers.WeightFiles(types.SimpleNamespace(workdir=str(tmp_path)), _params(1), 1, log_fn=print)
  assert not any(".tmp" in n for n in os.listdir(wdir))
  assert os.stat(os.path.join(wdir, "v1.npz")).st_mtime_ns == stamp
  pub.publish(_params(2), 2)
  load_newer()
  assert engine.loaded == [2] and float(engine.params["w"][0]) == 2.0


def test_versions_published_after_the_last_checkpoint_are_withdrawn_and_redone_once(tmp_path):
  wdir, logs = str(tmp_path / "weights"), []
  for v in (0, 1, 2, 3):
    weight_files.publish(wdir, _params(v), v)
  engine, load_newer = _worker(wdir)                                  # a worker serving v3
  # The trainer died after publishing v3 but its last checkpoint is step 1: v2 and v3 will be redone.
  publishers.WeightFiles(types.SimpleNamespace(workdir=str(tmp_path)), _params(1), 1, log_fn=logs.append)
  # (v0 pruned: keep=3)
  assert weight_files.latest(wdir)[0] == 1 and sorted(os.listdir(wdir)) == ["latest.json", "v1.npz"]
  assert logs == ["withdrew weights v[2, 3] published after the checkpoint at step 1: those steps are redone"]
  load_newer()
  assert engine.loaded == [1] and float(engine.params["w"][0]) == 1.0     # back to the checkpoint's weights
  pub = publishers.WeightFiles(types.SimpleNamespace(workdir=str(tmp_path)), _params(1), 1, log_fn=logs.append)
  for v, x in ((2, 2.5), (3, 3.5)):                                       # the redone steps' other weights
    pub.publish(_params(x), v)
    load_newer()
  assert engine.loaded == [1, 2, 3] and float(engine.params["w"][0]) == 3.5
  assert float(weight_files.load(os.path.join(wdir, "v2.npz"), LIKE)["w"][0]) == 2.5
