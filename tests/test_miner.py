"""rollout/tasks/miner.py on a real git repository built in the test: valid commits become tasks whose hidden
tests fail before and pass with the gold patch; the others are rejected with the right reason. The repository holds
the cases that once produced wrong labels: a test that errors before the fix, a fix whose test fails only in a
subtest, a flaky test, a revert of a commit in the set (named in its message, or found only by its diff), a re-landed
change, two commits with the same subject, a prompt that is only an issue reference."""

import os
import subprocess

import pytest

from rollout.tasks import environment, miner
from rollout.workspace import LocalFactory
from tests.tasks_testlib import FAST, commit, git, init_repo, sandbox_factory

CALC_V1 = '''"""Small arithmetic helpers."""


def add(a, b):
    return a + b


def sub(a, b):
    return b - a
'''
TEST_V1 = '''from calc import add


def test_add():
    assert add(2, 3) == 5
'''
CLAMP_V1 = "def clamp(x, lo, hi):\n    return max(lo, x)\n"
CLAMP_TEST = '''import unittest

from clamp import clamp


class TestClamp(unittest.TestCase):
    def test_clamp(self):
        for x, want in CASES:
            with self.subTest(x=x):
                self.assertEqual(clamp(x, 0, 10), want)
'''
FLAKY_TEST = '''import os

from steps import double

COUNTER = {counter!r}


def test_double():
    assert double(4) == 8


def test_flaky():
    n = int(open(COUNTER).read()) + 1 if os.path.exists(COUNTER) else 1
    open(COUNTER, "w").write(str(n))
    assert n % 2 == 0
'''
STEPS_V1 = "def inc(x):\n    return x + 2\n\n\ndef dec(x):\n    return x - 2\n"
STEPS_TEST = "from steps import dec, inc\n\n\ndef test_inc():\n    assert inc(1) == 2\n"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
  repo = tmp_path_factory.mktemp("repo")
  init_repo(repo)
  shas = {}
  shas["init"] = commit(repo, {"calc.py": CALC_V1, "tests/test_calc.py": TEST_V1}, "Initial calc module")
  calc2 = CALC_V1 + "\n\ndef mul(a, b):\n    return a * b\n"
  test2 = TEST_V1.replace("from calc import add", "from calc import add, mul") + \
    "\n\ndef test_mul():\n    assert mul(4, 5) == 20\n"
  shas["mul"] = commit(repo, {"calc.py": calc2, "tests/test_calc.py": test2}, "Add mul for products")
  calc3 = calc2.replace("return b - a", "return a - b")
  test3 = test2.replace("from calc import add, mul", "from calc import add, mul, sub") + \
    "\n\ndef test_sub():\n    assert sub(7, 2) == 5\n"
  shas["sub"] = commit(repo, {"calc.py": calc3, "tests/test_calc.py": test3}, "sub returns the wrong sign",
                       body="Subtraction had its operands swapped.\n\nFixes #41, see https://example.com/bug/41\n"
                            "Signed-off-by: T <t@t>")
  shas["docs"] = commit(repo, {"README.md": "# calc\n"}, "Add a README file")
  calc5 = calc3.replace('"""Small arithmetic helpers."""', '"""Arithmetic helpers."""')
  shas["refactor"] = commit(repo, {"calc.py": calc5, "tests/test_calc.py": test3 + "\n# more later\n"},
                            "Reword the module docstring")
  shas["code_only"] = commit(repo, {"calc.py": calc5 + "\n\ndef neg(a):\n    return -a\n"}, "Add neg for negation")
  shas["issue_ref"] = commit(repo, {"calc.py": calc5 + "\n\ndef neg(a):\n    return -a\n\n\ndef sq(a):\n"
                                    "    return a * a\n", "tests/test_sq.py": "from calc import sq\n\n\n"
                                    "def test_sq():\n    assert sq(3) == 9\n"}, "Issue: #898")
  shas["clamp_v1"] = commit(repo, {"clamp.py": CLAMP_V1, "tests/test_clamp.py": "CASES = [(5, 5), (-3, 0)]\n" +
                                   CLAMP_TEST}, "Add clamp to keep values in range")
  shas["clamp_fix"] = commit(repo, {"clamp.py": "def clamp(x, lo, hi):\n    return min(hi, max(lo, x))\n",
                                    "tests/test_clamp.py": "CASES = [(5, 5), (-3, 0), (50, 10)]\n" + CLAMP_TEST},
                             "clamp ignores the upper bound")
  counter = str(tmp_path_factory.mktemp("flaky") / "count")
  shas["flaky"] = commit(repo, {"steps.py": STEPS_V1 + "\n\ndef double(x):\n    return 2 * x\n",
                                "tests/test_steps.py": FLAKY_TEST.format(counter=counter)},
                         "Add double to the steps module")
  steps_triple = STEPS_V1 + "\n\ndef double(x):\n    return 2 * x\n\n\ndef triple(x):\n    return 3 * x\n"
  shas["triple"] = commit(repo, {"steps.py": steps_triple, "tests/test_steps.py": FLAKY_TEST.format(counter=counter) +
                                 "\n\ndef test_triple():\n    from steps import triple\n    assert triple(2) == 6\n"},
                          "Add triple to the steps module")
  subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "revert", "--no-edit",
                  shas["triple"]], check=True, capture_output=True)
  shas["revert"] = git(repo, "rev-parse", "HEAD").strip()
  steps2 = STEPS_V1.replace("x + 2", "x + 1") + "\n\ndef double(x):\n    return 2 * x\n"
  test_steps = STEPS_TEST + "\n\ndef test_dec():\n    assert dec(1) == 0\n"
  shas["dup1"] = commit(repo, {"steps.py": steps2, "tests/test_steps.py": STEPS_TEST},
                        "Fix an off-by-one error in the helpers")
  shas["dup2"] = commit(repo, {"steps.py": steps2.replace("x - 2", "x - 1"), "tests/test_steps.py": test_steps},
                        "Fix an off-by-one error in the helpers")
  # A revert found only by its diff: no "This reverts commit" line, and a commit in between moves its lines.
  shas["shift"] = commit(repo, {"steps.py": "# Step helpers.\n" + steps2.replace("x - 2", "x - 1")},
                         "Say what the steps module holds")
  shas["silent_revert"] = commit(repo, {"steps.py": "# Step helpers.\n" + steps2, "tests/test_steps.py": STEPS_TEST},
                                 "Go back to steps of two in dec")
  shas["reland"] = commit(repo, {"steps.py": "# Step helpers.\n" + steps2.replace("x - 2", "x - 1"),
                                 "tests/test_steps.py": test_steps}, "Step dec by one like inc")
  return str(repo), shas


@pytest.fixture(scope="module")
def mined(repo, tmp_path_factory):
  path, shas = repo
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path_factory.mktemp("ws"))))
  lines = []
  tasks, rejected = miner.mine(path, envs, FAST, log=lines.append)
  return envs, {t.metadata["commit"]: t for t in tasks}, {r.commit: r.reason for r in rejected}, lines


def test_rejections_name_their_reason(repo, mined):
  _, shas = repo
  _, tasks, reasons, lines = mined
  inverse = "reverts an older commit in the set (its gold diff is the inverse of {}'s)"
  assert set(tasks) == {shas[k] for k in ("mul", "sub", "clamp_v1", "clamp_fix", "flaky", "triple", "dup1", "dup2")}
  assert reasons == {
    shas["init"]: "root commit (no parent to start from)", shas["docs"]: "no code file changed",
    shas["refactor"]: "no test goes from failing to passing", shas["code_only"]: "no test file changed",
    shas["issue_ref"]: "prompt not self-contained (0 words after dropping references < min_prompt_words=3)",
    shas["revert"]: inverse.format(shas["triple"][:12]), shas["shift"]: "no test file changed",
    shas["silent_revert"]: inverse.format(shas["dup2"][:12]),
    shas["reland"]: f"repeats an older commit in the set (its gold diff is the same as {shas['dup2'][:12]}'s)"}
  assert "17 commits, kept 8, rejected 9" in lines[-1] and "prompt not self-contained x1" in lines[-1]


def test_labels_erroring_before_subtests_and_flaky(repo, mined):
  _, shas = repo
  _, tasks, _, _ = mined
  sub = tasks[shas["sub"]]
  assert sub.prompt == "sub returns the wrong sign\n\nSubtraction had its operands swapped."  # refs and trailer gone
  assert sub.tests.fail_to_pass == ("tests/test_calc.py::test_sub",)
  assert set(sub.tests.pass_to_pass) == {"tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"}
  assert sub.metadata["changed_files"] == ["calc.py"] and sub.metadata["changed_lines"] == 2
  # Before "Add mul" the test file cannot even import: both of its tests error before and pass after.
  assert tasks[shas["mul"]].tests.fail_to_pass == ("tests/test_calc.py::test_add", "tests/test_calc.py::test_mul")
  # A new module's test errors before (nothing to import) and passes after.
  assert tasks[shas["clamp_v1"]].tests.fail_to_pass == ("tests/test_clamp.py::TestClamp::test_clamp",)
  # The fix whose new case fails only in a subtest: the test failed before (its own call "passed").
  assert tasks[shas["clamp_fix"]].tests.fail_to_pass == ("tests/test_clamp.py::TestClamp::test_clamp",)
  flaky = tasks[shas["flaky"]]
  assert flaky.tests.fail_to_pass == ("tests/test_steps.py::test_double",) and flaky.tests.pass_to_pass == ()
  assert flaky.metadata["flaky"] == ["tests/test_steps.py::test_flaky"]
  # Duplicate subjects: two tasks, told apart by commit.
  assert tasks[shas["dup1"]].id != tasks[shas["dup2"]].id
  assert tasks[shas["dup2"]].tests.fail_to_pass == ("tests/test_steps.py::test_dec",)


def test_timeout_is_calibrated_from_the_gold_run(mined):
  _, tasks, _, _ = mined
  for t in tasks.values():
    assert t.tests.timeout_s == round(max(FAST.min_timeout_s, FAST.timeout_factor * t.metadata["gold_test_s"]), 1)
    assert 0 < t.metadata["gold_test_s"] < FAST.timeout_s


def test_tasks_grade_as_labelled(repo, mined):
  _, shas = repo
  envs, tasks, _, _ = mined
  for key in ("mul", "sub", "clamp_fix"):  # grading as the harness would: unsolved fails, gold patch passes
    task = tasks[shas[key]]
    ws = envs.fork(task)
    ws.write_file("tests/test_calc.py", "def test_add():\n    pass\n")  # an agent's tampering is undone at grading
    assert not environment.grade(ws, task.tests).passed
    ws.close()
    ws = envs.fork(task)
    assert environment.apply_patch(ws, task.gold_patch).ok
    report = environment.grade(ws, task.tests)
    ws.close()
    assert report.passed, report


def test_workspace_holds_only_the_history_up_to_the_parent(repo, mined):
  path, shas = repo
  envs, tasks, _, _ = mined
  ws = envs.fork(tasks[shas["sub"]])
  try:
    out = {cmd: ws.run(cmd).output.strip() for cmd in (
      "git rev-parse HEAD", "git log --all --reflog --format=%H", "git for-each-ref '--format=%(refname)'",
      "git remote", "ls .git", f"git cat-file -e {shas['sub']} && echo present || echo absent",
      f"git cat-file -e {shas['dup2']} && echo present || echo absent")}
  finally:
    ws.close()
  assert out["git rev-parse HEAD"] == shas["mul"]
  assert out["git log --all --reflog --format=%H"].split() == [shas["mul"], shas["init"]]
  assert out["git for-each-ref '--format=%(refname)'"] == "refs/heads/main" and out["git remote"] == ""
  assert "packed-refs" not in out["ls .git"] and "FETCH_HEAD" not in out["ls .git"]
  assert out[f"git cat-file -e {shas['sub']} && echo present || echo absent"] == "absent"  # the task's own fix
  assert out[f"git cat-file -e {shas['dup2']} && echo present || echo absent"] == "absent"  # the future


def test_subdirectory_relative_path_and_bad_repos(repo, tmp_path, monkeypatch):
  path, shas = repo
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  os.makedirs(os.path.join(path, "tests"), exist_ok=True)
  with pytest.raises(miner.MiningError, match=r"is a subdirectory of the git repository .*; pass the repository's"):
    miner.mine(os.path.join(path, "tests"), envs, FAST)
  with pytest.raises(miner.MiningError, match="not a git repository"):  # git's own message
    miner.mine(str(tmp_path), envs, FAST)
  monkeypatch.chdir(os.path.dirname(path))
  rel = os.path.basename(path)
  c = miner.Candidate(shas["sub"], shas["mul"], "sub returns the wrong sign")
  task = miner.mine_commit(miner.repo_root(rel), c, envs, FAST)
  assert task.environment.repo == path  # stored absolute: the task works from any working directory


def test_a_revert_named_only_by_its_message(repo, tmp_path):
  """A revert whose conflicts were resolved by hand has no exact inverse diff: its message still rejects it."""
  path, shas = repo
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  c = miner.Candidate(shas["dup1"], shas["revert"], 'Revert "Add triple"', f"This reverts commit {shas['triple']}.")
  out = miner.mine_commit(path, c, envs, FAST, in_set=frozenset(shas.values()))
  assert out == miner.Rejection(shas["dup1"], f"reverts a commit in the set ({shas['triple'][:12]})")


def test_miner_rejects_a_broken_gold_patch(repo, tmp_path):
  path, shas = repo
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  cfg = miner.MinerConfig(test_command=FAST.test_command.replace("{files}", "-k nothing_matches {files}"))
  out = miner.mine_commit(path, miner.Candidate(shas["sub"], shas["mul"], "sub has the wrong sign"), envs, cfg)
  assert isinstance(out, miner.Rejection) and out.reason == "no test goes from failing to passing"
  with pytest.raises(ValueError, match="runs_per_side must be >= 2"):
    miner.MinerConfig(runs_per_side=1)


@pytest.mark.slow
def test_miner_in_namespaced_sandboxes(repo):
  """The same mining with validation inside bubblewrap sandboxes (git, python and pytest run isolated)."""
  path, shas = repo
  factory = sandbox_factory()
  try:
    tasks, rejected = miner.mine(path, environment.EnvironmentCache(factory), FAST, log=lambda s: None)
    assert {t.metadata["commit"] for t in tasks} >= {shas["mul"], shas["sub"], shas["clamp_fix"]}
  finally:
    factory.close()
