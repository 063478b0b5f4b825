"""rollout/evaluation/gold_cache.py: a frozen set's gold checks are reused while the task, its environment and the
grader are unchanged, and the task is graded again as soon as any of them changes (a moved branch, edited labels,
another grader, another number of runs). Timeouts are never stored; a cut-short entry is a miss."""

import json
import os

import pytest

from rollout.evaluation import gold, gold_cache
from rollout.tasks import environment
from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import LocalFactory
from tests.tasks_testlib import commit, init_repo

CMD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider tests"
GOLD = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def two():\n-    return 3\n+    return 2\n"
TEST = "from calc import two\n\n\ndef test_two():\n    assert two() == 2\n"


@pytest.fixture()
def setup(tmp_path, monkeypatch):
  repo = tmp_path / "repo"
  init_repo(repo)
  commit(repo, {"calc.py": "def two():\n    return 3\n", "tests/__init__.py": ""}, "Start calc")
  task = Task("miner/repo/1", "python", "two returns 3", Environment(repo=str(repo), commit="main"),
              HiddenTests(CMD, ("tests/test_calc.py::test_two",), files={"tests/test_calc.py": TEST}),
              gold_patch=GOLD)
  f = LocalFactory(root=str(tmp_path / "ws"))
  calls = []
  real = gold.check_task
  monkeypatch.setattr(gold, "check_task", lambda t, *args: calls.append(t.id) or real(t, *args))
  yield repo, task, environment.EnvironmentCache(f), calls, str(tmp_path / "cache")
  f.close()


def test_reused_while_unchanged_and_regraded_after_any_change(setup, monkeypatch):
  repo, task, envs, calls, where = setup
  _, first = gold.validate([task], envs, cache=gold_cache.GoldCache(where), progress=False)
  assert first[0].valid and calls == ["miner/repo/1"]
  cache = gold_cache.GoldCache(where)  # a later evaluation: same set, environment and grader
  _, again = gold.validate([task], envs, cache=cache, progress=False)
  assert again == first and calls == ["miner/repo/1"] and cache.hits == 1
  # Another number of runs, other labels: graded again.
  gold.validate([task], envs, runs=3, cache=cache, progress=False)
  relabelled = Task(task.id, "python", task.prompt, task.environment,
                    HiddenTests(CMD, ("tests/test_calc.py::test_two", "tests/test_calc.py::test_three"),
                                files=task.tests.files), gold_patch=GOLD)
  _, checks = gold.validate([relabelled], envs, cache=cache, progress=False)
  assert not checks[0].valid and len(calls) == 3
  # The branch the environment names moves: the content changed, although the task's JSON did not.
  commit(repo, {"README.md": "calc\n"}, "Add a README")
  gold.validate([task], envs, cache=cache, progress=False)
  assert len(calls) == 4
  gold.validate([task], envs, cache=cache, progress=False)
  assert len(calls) == 4
  # Another grader or interpreter: graded again.
  monkeypatch.setattr(gold_cache, "grader_key", lambda: "edited grader")
  gold.validate([task], envs, cache=cache, progress=False)
  monkeypatch.setattr(gold_cache, "interpreter_key", lambda: "upgraded package")
  gold.validate([task], envs, cache=cache, progress=False)
  assert len(calls) == 6


def test_timeouts_are_not_stored_and_a_cut_entry_is_a_miss(setup):
  _, task, envs, calls, where = setup
  cache = gold_cache.GoldCache(where)
  key = cache.key(task, envs, 2)
  cache.put(key, gold.GoldCheck(task.id, False, "gold grading timed out (hidden tests timed out after 1 s)"))
  cache.put(key, gold.GoldCheck(task.id, False, "environment does not build: no such commit"))
  assert cache.get(key) is None and not os.path.exists(where)
  gold.validate([task], envs, cache=cache, progress=False)
  path = os.path.join(where, key[:2], key + ".json")
  assert json.load(open(path))["valid"] is True
  with open(path, "w") as f:
    f.write('{"task_id": "miner/re')  # a write cut short by a crash
  gold.validate([task], envs, cache=cache, progress=False)
  assert calls == [task.id, task.id] and json.load(open(path))["valid"] is True


def test_environment_key_reads_content(tmp_path):
  base = tmp_path / "base"
  base.mkdir()
  (base / "a.py").write_text("x = 1\n")
  env = Environment(base_dir=str(base))
  k1 = gold_cache.environment_key(env)
  assert k1 == gold_cache.environment_key(Environment(base_dir=str(base)))
  (base / "a.py").write_text("x = 2\n")
  assert gold_cache.environment_key(env) != k1
  assert gold_cache.environment_key(Environment(repo=str(tmp_path), commit="nope")) is None  # not a repo: unstored
  assert gold_cache.environment_key(Environment(base_dir=str(tmp_path / "gone"))) is None
