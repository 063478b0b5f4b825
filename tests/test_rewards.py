"""rollout/rewards.py: the length penalty and each reward term against hand-computed values."""

import math

import pytest

from rollout.rewards import EpisodeStats, RewardConfig, compute_reward, length_penalty


def test_length_penalty_hand_values():
  # q = 0.5, k = 1, x = 3: ((1 + 3)^0.5 - 1) / (1 * 0.5) = (2 - 1) / 0.5 = 2.
  assert length_penalty(3, 1.0, 0.5) == pytest.approx(2.0)
  # q = 0 is linear: ((1 + kx) - 1) / k = x.
  assert length_penalty(7, 0.3, 0.0) == pytest.approx(7.0)
  # q = 2, k = 0.5, x = 2: ((1 + 1)^-1 - 1) / (0.5 * -1) = (0.5 - 1) / -0.5 = 1.
  assert length_penalty(2, 0.5, 2.0) == pytest.approx(1.0)
  # q = 1 limit: log(1 + kx) / k; k = 1, x = e - 1 -> 1.
  assert length_penalty(math.e - 1, 1.0, 1.0) == pytest.approx(1.0)
  assert length_penalty(0, 0.1, 0.5) == 0.0


def test_length_penalty_q_limit_is_continuous_and_concave():
  for q in (1 - 1e-6, 1 + 1e-6):
    assert length_penalty(100, 0.05, q) == pytest.approx(length_penalty(100, 0.05, 1.0), rel=1e-4)
  xs = [0, 10, 20, 30]
  c = [length_penalty(x, 0.1, 0.5) for x in xs]
  steps = [b - a for a, b in zip(c, c[1:], strict=False)]
  assert all(s > 0 for s in steps) and steps[0] > steps[1] > steps[2]  # increasing, concave


def test_length_penalty_rejects_bad_input():
  with pytest.raises(ValueError, match="length must be >= 0"):
    length_penalty(-1, 0.1, 0.5)
  with pytest.raises(ValueError, match="k must be > 0"):
    length_penalty(1, 0.0, 0.5)
  with pytest.raises(ValueError, match="length_unit"):
    RewardConfig(length_unit="chars")


def test_compute_reward_each_term():
  cfg = RewardConfig(length_weight=0.1, length_k=1.0, length_q=0.5, length_unit="turns", todo_weight=0.2,
                     malformed_weight=0.3, repeat_weight=0.05, no_message_weight=0.5, lint_weight=0.01)
  stats = EpisodeStats(output_tokens=999, turns=3, tool_calls=9, malformed_calls=2, repeated_calls=4, finished=True,
                       final_message="  ", unfinished_todos=1, new_lint_findings=6)
  reward, terms = compute_reward(1.0, stats, cfg)
  want = {"task": 1.0, "length": -0.1 * 2.0, "todo": -0.2, "malformed": -0.6, "repeat": -0.2, "no_message": -0.5,
          "lint": -0.06}
  assert terms == pytest.approx(want)
  assert reward == pytest.approx(1.0 - 0.2 - 0.2 - 0.6 - 0.2 - 0.5 - 0.06)


def test_compute_reward_units_and_conditions():
  stats = EpisodeStats(output_tokens=8, turns=3, tool_calls=15, finished=False, final_message="", unfinished_todos=4)
  for unit, x in (("tokens", 8), ("turns", 3), ("tool_calls", 15)):
    cfg = RewardConfig(length_weight=1.0, length_k=1.0, length_q=0.0, length_unit=unit)
    assert compute_reward(0.0, stats, cfg)[1]["length"] == pytest.approx(-x)  # q = 0: C(x) = x
  # Not finished: open todos and a missing final message are not charged (the agent never claimed to be done).
  _, terms = compute_reward(0.0, stats, RewardConfig())
  assert terms["todo"] == 0.0 and terms["no_message"] == 0.0
  _, terms = compute_reward(0.0, EpisodeStats(finished=True, final_message="ok", unfinished_todos=4), RewardConfig())
  assert terms["todo"] == pytest.approx(-4 * RewardConfig().todo_weight) and terms["no_message"] == 0.0
