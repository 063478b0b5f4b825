"""Grading reads pytest's results from a report file our plugin writes, not from the capped console: a failing
subtest fails its test, a > 64 KB log loses no result, an import error is an error, a timeout is reported as one."""

import pytest

from rollout.tasks import environment
from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import LocalFactory

CMD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider tests"
SUBTESTS = '''import unittest


def half(x):
    return x // 2 if x != 7 else 99  # wrong for one input


class TestHalf(unittest.TestCase):
    def test_half(self):
        for x in range(10):
            with self.subTest(x=x):
                self.assertEqual(half(x), x // 2)

    def test_zero(self):
        self.assertEqual(half(0), 0)
'''
# 300 passing tests, then one failure that prints ~80 KB: the console is cut in the middle, the report is not.
LOUD = "import pytest\n\n\n@pytest.mark.parametrize('i', range(300))\ndef test_ok(i):\n    assert i >= 0\n\n\n" \
       "def test_loud():\n    print('x' * 80_000)\n    assert False\n"


@pytest.fixture()
def envs(tmp_path):
  f = LocalFactory(root=str(tmp_path / "ws"))
  yield environment.EnvironmentCache(f)
  f.close()


def _grade(envs, files, ids, timeout_s=60.0):
  task = Task("t", "python", "p", Environment(files=files), HiddenTests(CMD, tuple(ids), timeout_s=timeout_s))
  ws = envs.fork(task)
  try:
    return environment.grade(ws, task.tests)
  finally:
    ws.close()


def test_failing_subtest_fails_its_test(envs):
  rep = _grade(envs, {"tests/test_half.py": SUBTESTS},
               ["tests/test_half.py::TestHalf::test_half", "tests/test_half.py::TestHalf::test_zero"])
  assert rep.results == {"tests/test_half.py::TestHalf::test_half": "FAILED",
                         "tests/test_half.py::TestHalf::test_zero": "PASSED"}
  assert not rep.passed and rep.pass_fraction == 0.5


def test_a_long_log_loses_no_result(envs):
  ids = [f"tests/test_loud.py::test_ok[{i}]" for i in range(300)] + ["tests/test_loud.py::test_loud"]
  task = Task("t", "python", "p", Environment(files={"tests/test_loud.py": LOUD}), HiddenTests(CMD, tuple(ids)))
  ws = envs.fork(task)
  try:
    run = environment.run_tests(ws, CMD, "pytest", 60)
    rep = environment.grade(ws, task.tests)
  finally:
    ws.close()
  assert len(run.output) >= 60_000 and "x" * 1000 in run.output  # the console was capped ...
  assert sum(v == "PASSED" for v in run.results.values()) == 300  # ... the report was not
  assert rep.results["tests/test_loud.py::test_loud"] == "FAILED" and rep.pass_fraction == pytest.approx(300 / 301)


def test_import_error_setup_error_and_missing(envs):
  files = {"tests/test_broken.py": "import nothing_here\n\n\ndef test_a():\n    pass\n",
           "tests/test_fixture.py": "import pytest\n\n\n@pytest.fixture\ndef boom():\n    raise RuntimeError\n\n\n"
                                    "def test_b(boom):\n    pass\n"}
  ws_ids = ["tests/test_broken.py::test_a", "tests/test_fixture.py::test_b"]
  task = Task("t", "python", "p", Environment(files=files), HiddenTests(CMD, tuple(ws_ids)))
  ws = envs.fork(task)
  try:
    run = environment.run_tests(ws, CMD, "pytest", 60)
  finally:
    ws.close()
  assert run.results == {"tests/test_broken.py": "ERROR", "tests/test_fixture.py::test_b": "ERROR"}


def test_timeout_is_reported_as_a_timeout(envs):
  files = {"tests/test_slow.py": "import time\n\n\ndef test_fast():\n    pass\n\n\ndef test_slow():\n"
                                 "    time.sleep(30)\n"}
  rep = _grade(envs, files, ["tests/test_slow.py::test_fast", "tests/test_slow.py::test_slow"], timeout_s=4)
  assert rep.timed_out and rep.error.startswith(environment.TIMEOUT_ERROR)
  # What finished before the limit is in the report (written as each test ends).
  assert rep.results == {"tests/test_slow.py::test_fast": "PASSED", "tests/test_slow.py::test_slow": "MISSING"}


def test_a_command_setting_pythonpath_still_reports_and_no_report_is_an_error(envs):
  files = {"src/pkg/__init__.py": "def one():\n    return 1\n",
           "tests/test_pkg.py": "from pkg import one\n\n\ndef test_one():\n    assert one() == 1\n"}
  task = Task("t", "python", "p", Environment(files=files),
              HiddenTests("PYTHONPATH=src " + CMD, ("tests/test_pkg.py::test_one",)))
  ws = envs.fork(task)
  try:
    rep = environment.grade(ws, task.tests)
    silent = environment.grade(ws, HiddenTests("true", ("tests/test_pkg.py::test_one",)))
  finally:
    ws.close()
  assert rep.passed, rep
  assert not silent.passed and silent.error.startswith("the test command wrote no report")


def test_gold_validation_runs_each_side_twice_and_rejects_a_flaky_task(envs, tmp_path):
  from rollout.evaluation import gold
  counter = tmp_path / "count"
  flaky = (f"import os\n\nfrom calc import two\nC = {str(counter)!r}\n\n\ndef test_two():\n    assert two() == 2\n\n\n"
           "def test_flaky():\n    n = int(open(C).read()) + 1 if os.path.exists(C) else 1\n"
           "    open(C, 'w').write(str(n))\n    assert n % 2 == 0\n")
  patch = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def two():\n-    return 3\n+    return 2\n"
  files = {"calc.py": "def two():\n    return 3\n", "tests/test_calc.py": flaky}
  task = Task("t", "python", "p", Environment(files=files),
              HiddenTests(CMD, ("tests/test_calc.py::test_two",), ("tests/test_calc.py::test_flaky",)),
              gold_patch=patch)
  check = gold.check_task(task, envs)
  assert not check.valid and check.reason.startswith("flaky tests (unpatched results differ between 2 runs)")
  assert "tests/test_calc.py::test_flaky" in check.reason and int(counter.read_text()) == 2
  no_flaky = flaky.split("\n\n\ndef test_flaky")[0] + "\n"
  stable = Task("t", "python", "p", Environment(files={**files, "tests/test_calc.py": no_flaky}),
                HiddenTests(CMD, ("tests/test_calc.py::test_two",)), gold_patch=patch)
  check = gold.check_task(stable, envs)
  assert check.valid and check.gold_s > 0
  with pytest.raises(ValueError, match="at least twice"):
    gold.validate([stable], envs, runs=1)


@pytest.mark.parametrize("clean", [True, False])
def test_grading_removes_its_report_files_unless_told_not_to(envs, clean):
  """The report directory and plugin are removed after grading (a workspace that goes on sees none of them), or,
  with clean=False (a workspace closed next), left: the result is the same."""
  task = Task("t", "python", "p", Environment(files={"tests/test_a.py": "def test_a():\n    pass\n"}),
              HiddenTests(CMD, ("tests/test_a.py::test_a",)))
  ws = envs.fork(task)
  try:
    rep = environment.grade(ws, task.tests, clean=clean)
    left = [p for p in ws.list_dir(".") if "grade" in p]
  finally:
    ws.close()
  assert rep.passed and not rep.error
  assert (left == []) == clean and (clean or len(left) == 2), left   # the report dir and the plugin module
