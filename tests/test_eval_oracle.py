"""The gold-patch oracle on mined tasks: two commits with the same subject are told apart by commit, a task whose
patch does not fit `max_turn_tokens` is flagged (not counted as an oracle failure), and `fit_budget` sets budgets
from the set's patches so the oracle solves every task."""

import pytest

from composer_jax.train import tokenizer as tokenizer_lib
from rollout import harness
from rollout.engines import scripted
from rollout.evaluation import budget, policies, suite
from rollout.tasks import miner
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import LocalFactory
from tests.tasks_testlib import FAST, commit, init_repo

SUBJECT = "Fix an off-by-one error in the helpers"
STEPS = "def inc(x):\n    return x + 2\n\n\ndef dec(x):\n    return x - 2\n"
BIG = "".join(f"\n\ndef helper_{i}(x):\n    return x * {i} + {i * 7} - {i % 3}\n" for i in range(40))
CFG = harness.HarnessConfig(context_budget=3072, max_turn_tokens=512, observation_reserve=256, max_turns=8)


@pytest.fixture(scope="module")
def mined(tmp_path_factory):
  repo = tmp_path_factory.mktemp("dup")
  init_repo(repo)
  commit(repo, {"steps.py": STEPS, "tests/test_steps.py": "def test_nothing():\n    pass\n"}, "Initial steps module")
  commit(repo, {"steps.py": STEPS.replace("x + 2", "x + 1"),
                "tests/test_steps.py": "from steps import inc\n\n\ndef test_inc():\n    assert inc(1) == 2\n"}, SUBJECT)
  commit(repo, {"steps.py": STEPS.replace("x + 2", "x + 1").replace("x - 2", "x - 1"),
                "tests/test_steps.py": "from steps import dec, inc\n\n\ndef test_inc():\n    assert inc(1) == 2\n\n\n"
                                       "def test_dec():\n    assert dec(1) == 0\n"}, SUBJECT)
  commit(repo, {"steps.py": STEPS.replace("x + 2", "x + 1").replace("x - 2", "x - 1") + BIG,
                "tests/test_big.py": "from steps import helper_3\n\n\ndef test_h():\n    assert helper_3(1) == 24\n"},
         "Add forty helper functions to steps")
  envs = EnvironmentCache(LocalFactory(root=str(tmp_path_factory.mktemp("ws"))))
  tasks, _ = miner.mine(str(repo), envs, FAST, log=lambda s: None)
  texts = [STEPS, BIG, harness.SYSTEM_PROMPT] + [t.gold_patch for t in tasks]
  tok = tokenizer_lib.train_tokenizer(texts, tokenizer_lib.TokenizerConfig(400))
  return envs, tasks, tok


def test_same_subject_oracle_keys_by_commit_and_budget_is_flagged_then_fitted(tmp_path, mined):
  envs, tasks, tok = mined
  dup = [t for t in tasks if t.prompt == SUBJECT]
  assert len(tasks) == 3 and len(dup) == 2 and dup[0].id != dup[1].id
  big = next(t for t in tasks if t.prompt.startswith("Add forty"))
  need = max(policies.oracle_turn_tokens(big, tok))
  assert need > CFG.max_turn_tokens  # the big patch does not fit the preset
  pols = {n: suite.Policy(lambda ts, n=n: policies.baseline(n, tok, ts), tok) for n in ("oracle", "noop")}
  out = suite.evaluate({"m": tasks}, pols, envs, CFG, str(tmp_path / "a"), log=lambda s: None)["m"]
  assert out["oracle_over_budget"] == {big.id: need}
  assert out["validity_failures"] == {"oracle": [], "noop": []}  # the flagged task is not an oracle failure
  assert out["summaries"]["oracle"]["pass@1"] == pytest.approx(2 / 3)  # both same-subject tasks solved
  fitted = budget.fit_budget(tasks, tok, CFG)
  assert fitted.max_turn_tokens >= need and fitted.max_turn_tokens % 64 == 0
  assert fitted.context_budget > CFG.context_budget and fitted.observation_reserve == CFG.observation_reserve
  assert budget.fit_budget(dup, tok, CFG) == CFG  # small patches: the preset already fits, nothing lowered
  out = suite.evaluate({"m": tasks}, pols, envs, fitted, str(tmp_path / "b"), log=lambda s: None)["m"]
  assert out["oracle_over_budget"] == {} and out["summaries"]["oracle"]["pass@1"] == 1.0
  assert out["summaries"]["noop"]["pass@1"] == 0.0


def test_oracle_keyed_by_prompt_alone_fails_a_same_subject_task(tmp_path, mined):
  """The check above can fail: keyed by prompt alone, both same-subject episodes replay one task's patch."""
  envs, tasks, tok = mined
  dup = [t for t in tasks if t.prompt == SUBJECT]
  by_prompt = suite.Policy(lambda ts: scripted.ScriptedEngine(tok, scripted.oracle_policy(policies.with_oracle(ts))),
                           tok)
  out = suite.evaluate({"m": dup}, {"by_prompt": by_prompt}, envs, CFG, str(tmp_path / "c"), log=lambda s: None)["m"]
  assert out["summaries"]["by_prompt"]["pass@1"] == 0.5
