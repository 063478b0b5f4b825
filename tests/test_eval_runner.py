"""rollout/evaluation/runner.py bookkeeping: a line torn by a kill is ignored (its chunk re-runs), and resuming into
a directory that holds a run with other settings is refused with the differences named."""

import json

import pytest

from rollout import harness
from rollout.evaluation import runner
from rollout.tasks import procedural


def test_torn_last_line_is_ignored(tmp_path):
  good = {"task_id": "a", "policy": "p", "samples": []}
  (tmp_path / runner.RESULTS).write_text(json.dumps(good) + "\n" + '{"task_id": "b", "sam')
  assert runner.read_records(str(tmp_path)) == {"a": good}


def test_resume_with_other_settings_is_refused(tmp_path):
  tasks = procedural.generate(2, seed=0)
  info = {"policy": "p", "set": runner.set_fingerprint(tasks), "samples": 2, "chunk_tasks": 8, "seed": 0}
  (tmp_path / runner.RUN_INFO).write_text(json.dumps(info))
  with pytest.raises(ValueError, match="samples"):
    runner.run_policy("p", None, None, tasks, None, harness.HarnessConfig(), str(tmp_path),
                      runner.SampleConfig(samples=3), log=lambda s: None)
  with pytest.raises(ValueError, match="unique"):
    runner.run_policy("p", None, None, tasks + tasks[:1], None, harness.HarnessConfig(), str(tmp_path / "x"))
  with pytest.raises(ValueError, match="samples >= 1"):
    runner.SampleConfig(samples=0)
