"""A frozen task set whose gold patch no longer applies (its environment changed after the set was frozen): gold
validation names the task's field, the environment and git's own file and line; nothing is half-applied; an
evaluation left with no valid task says why."""

import os

import pytest

from rollout import harness
from rollout.evaluation import gold, suite
from rollout.evaluation.gold_cache import GoldCache
from rollout.tasks import environment, registry, setfile
from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import LocalFactory

CMD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider tests"
GOLD = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def two():\n-    return 3\n+    return 2\n"
TEST = "from calc import two\n\n\ndef test_two():\n    assert two() == 2\n"


@pytest.fixture()
def frozen(tmp_path):
  base = tmp_path / "base"
  (base / "tests").mkdir(parents=True)
  (base / "calc.py").write_text("def two():\n    return 3\n")
  task = Task("set/two", "python", "two returns 3", Environment(base_dir=str(base)),
              HiddenTests(CMD, ("tests/test_calc.py::test_two",), files={"tests/test_calc.py": TEST}),
              gold_patch=GOLD)
  dicts = [task.to_dict()]
  path = str(tmp_path / "x_v1.json")
  setfile.write_set(path, {"format": setfile.FORMAT, "name": "x", "version": "1", "tasks": dicts,
                           "sha256": setfile.tasks_digest(dicts)})
  f = LocalFactory(root=str(tmp_path / "ws"))
  yield base, path, environment.EnvironmentCache(f), str(tmp_path / "cache")
  f.close()


def test_a_gold_patch_that_no_longer_applies_is_named(frozen, tmp_path):
  base, path, envs, cache = frozen
  tasks = registry.load_tasks(registry.SetSpec("file", path=path), envs, log=lambda s: None)
  assert gold.validate(tasks, envs, cache=GoldCache(cache), progress=False)[1][0].valid
  (base / "calc.py").write_text("def two():\n    return 4\n")  # the environment moved on
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws2")))
  _, checks = gold.validate(tasks, envs, cache=GoldCache(cache), progress=False)
  reason = checks[0].reason
  assert not checks[0].valid
  assert reason.startswith(f"gold patch does not apply (task field gold_patch, to the directory {base}): "), reason
  assert "error: patch failed: calc.py:1" in reason and "calc.py: patch does not apply" in reason
  ws = envs.fork(tasks[0])  # a failed apply changes nothing and leaves no reject file
  try:
    assert not environment.apply_patch(ws, GOLD).ok
    assert ws.read_file("calc.py") == "def two():\n    return 4\n" and sorted(ws.list_dir(".")) == ["calc.py", "tests/"]
  finally:
    ws.close()
  with pytest.raises(ValueError, match=r"set 'x_v1' has no valid tasks \(gold patch does not apply x1\); every "
                                       r"task's reason is in "):
    suite.evaluate({"x_v1": tasks}, {}, envs, harness.HarnessConfig(), str(tmp_path / "out"),
                   gold_cache=GoldCache(cache), log=lambda s: None)
  assert os.path.exists(tmp_path / "out" / "x_v1" / "gold.jsonl")
