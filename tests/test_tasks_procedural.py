"""rollout/tasks/procedural.py + environment.py: determinism, disjoint splits, and that every task is valid:
hidden tests fail on the starting files, pass with the gold patch, and the grader reads them right."""

import json
import random
import re
import time

import pytest

from rollout.tasks import environment, procedural
from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import LocalFactory


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
  factory = LocalFactory(root=str(tmp_path_factory.mktemp("ws")))
  return environment.EnvironmentCache(factory)


def test_deterministic_and_distinct():
  a = procedural.generate(50, seed=3, level=2)
  b = procedural.generate(50, seed=3, level=2)
  assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
  assert len({t.id for t in a}) == 50
  assert procedural.generate(5, seed=4, level=2)[0].id != a[0].id


def test_splits_never_share_cores_and_generation_is_fast():
  start = time.perf_counter()
  train = procedural.generate(1000, seed=0, split="train", level=1)
  elapsed = time.perf_counter() - start
  held = procedural.generate(200, seed=0, split="heldout", level=1)
  train_cores = {c for t in train for c in t.metadata["cores"]}
  held_cores = {c for t in held for c in t.metadata["cores"]}
  assert train_cores.isdisjoint(held_cores)
  assert {t.id for t in train}.isdisjoint({t.id for t in held})
  assert elapsed < 10, f"1000 tasks took {elapsed:.1f}s"


def test_level1_is_small():
  for t in procedural.generate(20, level=1):
    (name, text), = t.environment.files.items()
    assert len(text.splitlines()) == 3 and t.metadata["changed_lines"] == 1
    assert [turn["tool_calls"][0]["name"] for turn in t.metadata["oracle"]] == ["read_file", "edit", "finish"]
    assert name in t.prompt and len(t.prompt) < 40


def test_task_dict_round_trip():
  t = procedural.generate(1, level=4)[0]
  d = json.loads(json.dumps(t.to_dict()))
  assert Task.from_dict(d) == t


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_hidden_tests_fail_before_and_pass_with_gold_patch(envs, level):
  for task in procedural.generate(3, seed=level, level=level, split="heldout" if level == 2 else "train"):
    ws = envs.fork(task)
    before = environment.grade(ws, task.tests)
    ws.close()
    assert not before.passed
    assert all(before.results[t] == "FAILED" for t in task.tests.fail_to_pass)
    assert all(before.results[t] == "PASSED" for t in task.tests.pass_to_pass)
    ws = envs.fork(task)
    assert environment.apply_patch(ws, task.gold_patch).ok
    after = environment.grade(ws, task.tests)
    ws.close()
    assert after.passed and after.pass_fraction == 1.0, after


def test_report_lines_and_missing_tests(envs):
  """Results come from the report file: printed lines do not count, unreported tests are MISSING, the worst of
  several lines for one id wins, and lines without this run's nonce are ignored."""
  from rollout.tasks import grade_report
  script = (grade_report.SCRIPT_REPORTER + "\nprint('PASSED t2')\n_write('t1', 'passed')\n_write('t2', 'failed')\n"
            "_write('t2', 'passed')\n")
  task = Task("t", "python", "p", Environment(files={"x.py": script}),
              HiddenTests("python3 x.py", fail_to_pass=("t1", "t2"), pass_to_pass=("t3",), report="script"))
  ws = envs.fork(task)
  report = environment.grade(ws, task.tests)
  ws.close()
  assert report.results == {"t1": "PASSED", "t2": "FAILED", "t3": "MISSING"}
  assert not report.passed and report.pass_fraction == pytest.approx(1 / 3)
  lines = ['{"id": "a", "outcome": "passed", "nonce": "n1"}', '{"id": "b", "outcome": "passed", "nonce": "n2"}',
           '{"id": "c", "outcome": "error", "nonce": "n1"}', '{"id": "c", "outcome": "passed", "nonce": "n1"}',
           '{"id": "d", "outcome": "pass', "not json"]
  assert grade_report.parse_report("\n".join(lines), "n1") == {"a": "PASSED", "c": "ERROR"}


def test_printed_output_cannot_forge_results(envs):
  """Code under test that prints fake PASSED lines (or writes fake report lines) and exits early does not pass."""
  task = procedural.generate(1, seed=2, level=1)[0]
  (path,) = task.environment.files
  fn = task.tests.fail_to_pass[0][len("test_"):]
  ws = envs.fork(task)
  fake = "".join(f"print('PASSED {t}')\n" for t in task.tests.fail_to_pass)
  # Finds the report file and writes lines with the only token it can see (the directory's name).
  fake += ("import glob, json\nfor _p in glob.glob('.grade_*/report.jsonl'):\n"
           "    with open(_p, 'a') as _f:\n" + "".join(
             f"        _f.write(json.dumps({{'id': '{t}', 'outcome': 'passed', 'nonce': _p.split('/')[0][7:]}}))\n"
             for t in task.tests.fail_to_pass))
  ws.write_file(path, "import os\n" + fake + f"def {fn}(*a):\n    os._exit(0)\n")
  report = environment.grade(ws, task.tests)
  ws.close()
  assert not report.passed and set(report.results.values()) == {"MISSING"}


def test_bad_config_and_environment_errors():
  with pytest.raises(ValueError, match="n_modules"):
    procedural.ProceduralConfig(n_modules=5)
  with pytest.raises(ValueError, match="unknown difficulty level"):
    procedural.generate(1, level=9)
  with pytest.raises(ValueError, match="fail_to_pass is empty"):
    HiddenTests("true", fail_to_pass=())
  with pytest.raises(ValueError, match=r"unknown HiddenTests.report 'stdout'; valid: \('pytest', 'script'\)"):
    HiddenTests("true", ("a",), report="stdout")
  with pytest.raises(ValueError, match="repo and commit go together"):
    Environment(repo="/x")


def test_docstring_states_the_fix():
  """Solvable from observation: the broken body disagrees with its docstring, and the oracle's fix makes them agree."""
  for t in procedural.generate(50, level=1):
    (text,) = t.environment.files.values()
    spec = re.search(r'"""Return (.*)\."""', text).group(1)
    body = re.search(r"\n    return (.*)\n", text).group(1)
    edit = t.metadata["oracle"][1]["tool_calls"][0]["arguments"]
    assert spec != body
    assert edit["old"] == f"return {body}" and edit["new"] == f"return {spec}"


def test_near_miss_demonstrations_make_a_wrong_fix(envs):
  """A near-miss oracle edits the broken line to another expression, which the hidden tests mostly catch."""
  rng = random.Random(0)
  failed = 0
  tasks = procedural.generate(20, seed=3, level=1)
  for task in tasks:
    miss = procedural.near_miss(task, rng)
    edit = miss.metadata["oracle"][1]["tool_calls"][0]["arguments"]
    good = task.metadata["oracle"][1]["tool_calls"][0]["arguments"]
    assert edit["old"] == good["old"] and edit["new"] not in (good["new"], good["old"]) and miss.metadata["near_miss"]
    ws = envs.fork(task)
    (path, text), = task.environment.files.items()
    ws.write_file(path, text.replace(edit["old"], edit["new"]))
    failed += not environment.grade(ws, task.tests).passed
    ws.close()
  # A wrong expression can agree with the right one on the 3 tested inputs (weak hidden tests), so not all fail.
  assert failed >= 16, failed
