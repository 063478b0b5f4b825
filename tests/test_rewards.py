"""rollout/rewards.py: the length penalty and each reward term against hand-computed values."""

import dataclasses
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
  _, terms = compute_reward(0.0, EpisodeStats(finished=True, final_message="ok", unfinished_todos=4), RewardConfig())
  assert terms["todo"] == pytest.approx(-4 * RewardConfig().todo_weight) and terms["no_message"] == 0.0


# Each behavioural term's edge case: the cheapest way to max the term out must not pay more than solving.

def test_todo_and_message_terms_cannot_be_dodged_by_never_finishing():
  """Hidden tests grade the workspace however the episode ends, so a term charged only at `finish` could be
  avoided by running into the turn limit instead: both are charged at any end."""
  cfg = RewardConfig()
  finished = EpisodeStats(finished=True, final_message="", unfinished_todos=2)
  ran_out = EpisodeStats(finished=False, final_message="", unfinished_todos=2)
  for stats in (finished, ran_out):
    _, terms = compute_reward(1.0, stats, cfg)
    assert terms["todo"] == pytest.approx(-2 * cfg.todo_weight)
    assert terms["no_message"] == pytest.approx(-cfg.no_message_weight)
  # The only way to zero both: tick the list off and tell the user.
  _, terms = compute_reward(1.0, EpisodeStats(finished=True, final_message="Fixed f.", unfinished_todos=0), cfg)
  assert terms["todo"] == 0.0 and terms["no_message"] == 0.0


RECIPE = RewardConfig(length_weight=4.75e-4, length_k=0.01, length_q=0.5, todo_weight=0.05, malformed_weight=0.05,
                      repeat_weight=0.02, no_message_weight=0.05, lint_weight=0.0, penalty_cap=0.5)


@pytest.mark.parametrize("term,stats,want", [
  ("length", EpisodeStats(output_tokens=100_000, final_message="ok"), 0.5),        # any number of tokens
  ("malformed", EpisodeStats(malformed_calls=500, final_message="ok"), 0.5),
  ("repeat", EpisodeStats(repeated_calls=500, final_message="ok"), 0.5),
  ("todo", EpisodeStats(unfinished_todos=200, final_message="ok"), 0.5),
  ("no_message", EpisodeStats(final_message=""), 1.0 - 0.05),                     # 0/1: its weight at most
  ("all", EpisodeStats(output_tokens=100_000, malformed_calls=500, repeated_calls=500, unfinished_todos=200), 0.5),
])
def test_a_solved_episode_outscores_every_unsolved_one_whatever_it_costs(term, stats, want):
  """With the cap, however bad a term gets, solving still beats the best unsolved episode (a no-op: 0 tokens, no
  calls, a message; every penalty at its maximum of 0), and each term's share shrinks in proportion."""
  best_unsolved, terms_u = compute_reward(0.0, EpisodeStats(finished=True, final_message="Done."), RECIPE)
  assert best_unsolved == 0.0 and all(v == 0.0 for k, v in terms_u.items() if k != "task")
  solved, terms = compute_reward(1.0, stats, RECIPE)
  assert solved == pytest.approx(want) and solved > best_unsolved
  assert sum(terms.values()) == pytest.approx(solved)
  if term != "all":  # the one term carries the whole penalty; the others stay 0
    assert terms[term] == pytest.approx(want - 1.0)
    assert all(v == 0.0 for k, v in terms.items() if k not in (term, "task"))


def test_penalty_cap_scales_in_proportion_and_leaves_small_penalties_alone():
  cfg = RewardConfig(malformed_weight=0.1, repeat_weight=0.1, todo_weight=0.0, no_message_weight=0.0,
                     lint_weight=0.0, penalty_cap=0.5)
  # Below the cap: unchanged (3 x 0.1 = 0.3).
  r, terms = compute_reward(1.0, EpisodeStats(malformed_calls=2, repeated_calls=1), cfg)
  assert r == pytest.approx(0.7)
  assert terms["malformed"] == pytest.approx(-0.2) and terms["repeat"] == pytest.approx(-0.1)
  # Above: 6 malformed (0.6) + 2 repeats (0.2) = 0.8 -> 0.5, scaled by 5/8: -0.375 and -0.125.
  r, terms = compute_reward(1.0, EpisodeStats(malformed_calls=6, repeated_calls=2), cfg)
  assert r == pytest.approx(0.5)
  assert terms["malformed"] == pytest.approx(-0.375) and terms["repeat"] == pytest.approx(-0.125)
  # An unsolved episode is floored at -cap too: still below every solved one.
  assert compute_reward(0.0, EpisodeStats(malformed_calls=100), cfg)[0] == pytest.approx(-0.5)
  with pytest.raises(ValueError, match="penalty_cap"):
    RewardConfig(penalty_cap=1.0)


def test_every_term_but_task_is_a_penalty():
  """No behavioural term can add reward, so no unsolved episode scores above 0 (nothing to farm)."""
  cfg = RewardConfig(length_weight=0.01, lint_weight=0.02)
  for stats in (EpisodeStats(), EpisodeStats(output_tokens=50, turns=3, tool_calls=4, malformed_calls=1,
                                             repeated_calls=1, finished=True, final_message="x", unfinished_todos=1,
                                             new_lint_findings=2)):
    r, terms = compute_reward(0.0, stats, cfg)
    assert r <= 0.0 and all(v <= 0.0 for k, v in terms.items() if k != "task")


# Giving up vs trying: the effort terms (length, todo, lint) and `effort_scope`.

GIVE_UP = EpisodeStats(output_tokens=30, turns=1, tool_calls=1, finished=True, final_message="Done.")
FAILED_TRY = EpisodeStats(output_tokens=340, turns=9, tool_calls=9, finished=True, final_message="Fixed.",
                          unfinished_todos=2, new_lint_findings=1)


def test_charged_to_every_episode_giving_up_outscores_a_failed_attempt():
  """The loophole `effort_scope="solved"` closes, by hand at the recipe's weights (λ = 4.7536e-4, k = 0.01,
  q = 0.5): calling finish at once pays λ C(30) = λ (1.3^0.5 - 1) / 0.005 = 0.0133; a failed 340-token attempt
  with 2 todo items open pays λ C(340) = λ (4.4^0.5 - 1) / 0.005 = 0.1044 + 2 x 0.05 = 0.2044."""
  cfg = dataclasses.replace(RECIPE, length_weight=4.7536e-4)
  give_up, _ = compute_reward(0.0, GIVE_UP, cfg)
  tried, terms = compute_reward(0.0, FAILED_TRY, cfg)
  assert give_up == pytest.approx(-0.0133, abs=1e-4) and tried == pytest.approx(-0.2044, abs=1e-4)
  assert terms["length"] == pytest.approx(-0.1044, abs=1e-4) and terms["todo"] == pytest.approx(-0.1)
  assert give_up > tried


def test_effort_scope_solved_charges_length_todo_lint_to_solved_episodes_only():
  cfg = RewardConfig(length_weight=0.1, length_k=1.0, length_q=0.0, todo_weight=0.05, lint_weight=0.02,
                     malformed_weight=0.05, repeat_weight=0.02, no_message_weight=0.05, effort_scope="solved")
  every = dataclasses.replace(cfg, effort_scope="all")
  # Unsolved: the effort terms are 0, trying or not, so the two tie at 0 ...
  for stats in (GIVE_UP, FAILED_TRY):
    r, terms = compute_reward(0.0, stats, cfg)
    assert r == 0.0 and terms["length"] == terms["todo"] == terms["lint"] == 0.0
  # ... while the tool-use terms are charged to every episode: 2 malformed, 1 repeat, no message = -0.17.
  sloppy = EpisodeStats(output_tokens=40, malformed_calls=2, repeated_calls=1, unfinished_todos=3)
  r, terms = compute_reward(0.0, sloppy, cfg)
  assert r == pytest.approx(-0.17) and terms["todo"] == terms["length"] == 0.0
  # Solved: every term, exactly as with 'all'.
  for stats in (GIVE_UP, FAILED_TRY, sloppy):
    assert compute_reward(1.0, stats, cfg) == compute_reward(1.0, stats, every)
  # Between two successes the shorter, tidier one still scores higher.
  assert compute_reward(1.0, GIVE_UP, cfg)[0] > compute_reward(1.0, FAILED_TRY, cfg)[0]
  with pytest.raises(ValueError, match="effort_scope"):
    RewardConfig(effort_scope="unsolved")
