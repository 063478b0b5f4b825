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
