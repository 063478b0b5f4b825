"""The applied log survives a torn last line (a disk that filled mid-append) and refuses damage elsewhere."""
import json

import pytest

from composer_jax.rl.trainer import _truncate_applied


def _write(path, text):
  path.write_text(text)
  return str(path)


def test_a_torn_last_line_is_dropped_and_steps_after_the_checkpoint_too(tmp_path):
  rows = [{"step": s, "keys": [f"g{s}"]} for s in (1, 2, 3)]
  path = _write(tmp_path / "applied.jsonl", "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "ke')
  _truncate_applied(path, 2)
  assert [json.loads(line) for line in open(path)] == rows[:2]


def test_a_torn_last_line_at_the_checkpoint_step_keeps_the_earlier_lines(tmp_path):
  path = _write(tmp_path / "applied.jsonl", json.dumps({"step": 1, "keys": ["a"]}) + "\n" + '{"step": 2,')
  _truncate_applied(path, 5)
  assert [json.loads(line) for line in open(path)] == [{"step": 1, "keys": ["a"]}]


def test_a_damaged_line_before_the_last_is_refused_by_file_and_line(tmp_path):
  good = json.dumps({"step": 3, "keys": ["c"]})
  path = _write(tmp_path / "applied.jsonl", f'{good}\n{{"step": 4, "ke\n{good}\n')
  with pytest.raises(ValueError, match=r"applied.jsonl: line 2 is not JSON"):
    _truncate_applied(path, 5)
  assert open(path).read().count("\n") == 3   # nothing rewritten
