"""Metric files and plots: the trailing mean drawn over noisy per-step RL metrics."""
import json

import pytest

from composer_jax.train import metrics


def test_moving_average_hand_computed():
  # window 3: [1], [1,2], [1,2,3], [2,3,4], [3,4,5]
  assert metrics.moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 3) == pytest.approx([1.0, 1.5, 2.0, 3.0, 4.0])
  assert metrics.moving_average([4.0, 0.0], 1) == [4.0, 0.0]


def test_plot_metrics_smoothed_and_raw(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "reward": s % 2}) + "\n" for s in range(1, 41)))
  for smooth in (0, 10):
    out = tmp_path / f"reward{smooth}.png"
    metrics.plot_metrics(str(path), str(out), ("reward",), smooth=smooth)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measured_points_skip_steps_a_metric_was_not_measured():
  rows = [{"step": 1, "gap": 0.5}, {"step": 2, "gap": float("nan")}, {"step": 3}, {"step": 4, "gap": 2}]
  assert metrics.measured_points(rows, "gap") == [(1, 0.5), (4, 2)]


def test_part_means_by_hand_and_plot_lines(tmp_path):
  rows = [{"step": s, "a": float(s), "b": float(s) if s % 2 else float("nan")} for s in range(1, 10)]
  # a: 9 values in 4 parts of 2, the last takes the remainder: [1, 2] [3, 4] [5, 6] [7, 8, 9]
  # b: measured at the odd steps only (NaN elsewhere): [1] [3] [5] [7, 9]
  assert metrics.part_means(rows, ["a", "b", "missing"]) == {"a": [1.5, 3.5, 5.5, 8.0], "b": [1.0, 3.0, 5.0, 8.0]}
  assert metrics.part_means(rows[:3], ["a"]) == {}   # fewer rows than parts
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  metrics.plot_lines(str(path), str(tmp_path / "terms.png"), ("a", "b"), title="t", ylabel="y")
  assert (tmp_path / "terms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
