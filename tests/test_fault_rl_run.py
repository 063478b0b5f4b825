"""The RL loop end to end through faults (sync mode, the tiny test model): a grading timeout in the middle of a group,
and a truncated and a newer-format record landing in the queue. The run finishes, `applied.jsonl` holds every step's
groups once and none of the unreadable records, and the per-step metrics count each fault. The faults one at a time,
faster, are in the other test_fault_*.py files."""
import dataclasses
import itertools
import json
import os
import struct
import threading
import zlib

import numpy as np
import pytest

from composer_jax import configs
from composer_jax.rl import loop, setup, sources
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs
from rollout import harness
from rollout.queue import QueueProducer

pytestmark = pytest.mark.slow   # a warm start and three RL steps: ~60 s on a loaded 2-core machine


def test_a_sync_run_through_faults_applies_every_group_once(tmp_path, monkeypatch):
  cfg = configs.replace(configs.from_dict(RunConfig, rl_configs.get_config("test,mode=sync"), workdir=str(tmp_path)),
                        **{"rl.steps": 3, "rl.ckpt_every": 1})
  real_grade, calls, lock = harness.grade, itertools.count(), threading.Lock()
  armed = threading.Event()   # set when RL starts: the warm start's oracle episodes are graded too

  def second_rl_grade_times_out(ws, tests, **kwargs):   # in step 1's first group: a real timeout
    with lock:
      i = next(calls) if armed.is_set() else -1
    if i == 1:
      tests = dataclasses.replace(tests, command="sleep 3; " + tests.command, timeout_s=0.5)
    return real_grade(ws, tests, **kwargs)

  bad_keys, real_next = [], sources.InProcess.next

  def next_after_bad_records(self, policy_version):
    armed.set()
    if policy_version == 1:   # before step 2: another producer's records, one torn and one from a newer codec version
      intruder = QueueProducer(setup.queue_url(cfg.workdir), "intruder")
      for damage in (lambda b: b[:len(b) // 2], lambda b: b"CJQ2" + b[4:-4] + struct.pack("<I", zlib.crc32(
          b"CJQ2" + b[4:-4]))):
        key = intruder.append({"x": np.zeros(8)}, {"bad": True}, policy_version=policy_version, n_rows=1)
        intruder.kv.write(key, damage(intruder.kv.read(key).result().value)).result()
        bad_keys.append(key)
    return real_next(self, policy_version)

  monkeypatch.setattr(harness, "grade", second_rl_grade_times_out)
  monkeypatch.setattr(sources.InProcess, "next", next_after_bad_records)
  with pytest.warns(UserWarning, match="skipping unreadable queue record"):
    out = loop.run_rl(cfg, log_fn=lambda s: None)
  assert int(out["last"]["step"]) == 3
  applied = [json.loads(line) for line in open(os.path.join(tmp_path, "applied.jsonl"))]
  keys = [k for r in applied for k in r["keys"]]
  assert [r["step"] for r in applied] == [1, 2, 3]
  assert len(keys) == len(set(keys)) == 3 * cfg.rl.groups_per_step and not set(keys) & set(bad_keys)
  m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert (m[-1]["corrupt"], m[-1]["newer_format"]) == (1.0, 1.0)
  assert m[-1]["grade_timeouts"] == 1.0 and m[-1]["groups_retried"] == 1.0 and "groups_dropped" not in m[-1]
