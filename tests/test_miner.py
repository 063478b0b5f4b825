"""rollout/tasks/miner.py on a real git repository built in the test: valid commits become tasks whose hidden
tests fail before and pass with the gold patch; the others are rejected with the right reason."""

import subprocess

import pytest

from rollout.tasks import environment, miner
from rollout.workspace import LocalFactory

# Plugins of the surrounding venv are not needed by these tests and double pytest's start-up.
FAST = miner.MinerConfig(test_command="PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " + miner.MinerConfig().test_command)

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


def _commit(repo, files: dict, message: str) -> str:
  for path, text in files.items():
    p = repo / path
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
  subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
  subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message],
                 check=True)
  return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
  repo = tmp_path_factory.mktemp("repo")
  subprocess.run(["git", "init", "-q", str(repo)], check=True)
  shas = {}
  shas["init"] = _commit(repo, {"calc.py": CALC_V1, "tests/test_calc.py": TEST_V1}, "Initial calc module")
  calc2 = CALC_V1 + "\n\ndef mul(a, b):\n    return a * b\n"
  test2 = TEST_V1.replace("from calc import add", "from calc import add, mul") + \
    "\n\ndef test_mul():\n    assert mul(4, 5) == 20\n"
  shas["mul"] = _commit(repo, {"calc.py": calc2, "tests/test_calc.py": test2}, "Add mul")
  calc3 = calc2.replace("return b - a", "return a - b")
  test3 = test2.replace("from calc import add, mul", "from calc import add, mul, sub") + \
    "\n\ndef test_sub():\n    assert sub(7, 2) == 5\n"
  shas["sub"] = _commit(repo, {"calc.py": calc3, "tests/test_calc.py": test3}, "sub returns the wrong sign")
  shas["docs"] = _commit(repo, {"README.md": "# calc\n"}, "Add a README")
  calc5 = calc3.replace('"""Small arithmetic helpers."""', '"""Arithmetic helpers."""')
  shas["refactor"] = _commit(repo, {"calc.py": calc5, "tests/test_calc.py": test3 + "\n# more later\n"},
                             "Reword docstring")
  shas["code_only"] = _commit(repo, {"calc.py": calc5 + "\n\ndef neg(a):\n    return -a\n"}, "Add neg")
  return str(repo), shas


def test_miner_produces_validated_tasks(repo, tmp_path):
  path, shas = repo
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  tasks, rejected = miner.mine(path, envs, FAST)
  assert {t.metadata["commit"] for t in tasks} == {shas["mul"], shas["sub"]}
  reasons = {r.commit: r.reason for r in rejected}
  assert reasons == {shas["init"]: "root commit (no parent to start from)", shas["docs"]: "no code file changed",
                     shas["refactor"]: "no test goes from failing to passing",
                     shas["code_only"]: "no test file changed"}
  by = {t.metadata["commit"]: t for t in tasks}
  sub = by[shas["sub"]]
  assert sub.prompt == "sub returns the wrong sign"
  assert sub.tests.fail_to_pass == ("tests/test_calc.py::test_sub",)
  assert set(sub.tests.pass_to_pass) == {"tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"}
  assert sub.metadata["changed_files"] == ["calc.py"] and sub.metadata["changed_lines"] == 2
  # Before "Add mul" the test file cannot even import, so test_add fails too: both go from failing to passing.
  assert by[shas["mul"]].tests.fail_to_pass == ("tests/test_calc.py::test_add", "tests/test_calc.py::test_mul")
  for task in tasks:  # grading the task as the harness would: unsolved fails, gold patch passes
    ws = envs.fork(task)
    ws.write_file("tests/test_calc.py", "def test_add():\n    pass\n")  # an agent's tampering is undone at grading
    assert not environment.grade(ws, task.tests).passed
    ws.close()
    ws = envs.fork(task)
    assert environment.apply_patch(ws, task.gold_patch).ok
    report = environment.grade(ws, task.tests)
    ws.close()
    assert report.passed, report


def test_miner_rejects_a_broken_gold_patch(repo, tmp_path):
  path, shas = repo
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  cfg = miner.MinerConfig(test_command=FAST.test_command.replace("{files}", "-k nothing_matches {files}"))
  out = miner.mine_commit(path, shas["sub"], shas["mul"], "x", envs, cfg)
  assert isinstance(out, miner.Rejection) and out.reason == "no test goes from failing to passing"
  with pytest.raises(ValueError, match="git"):
    miner.mine(str(tmp_path), envs)  # not a repository


@pytest.mark.slow
def test_miner_in_namespaced_sandboxes(repo):
  """The same mining with validation inside bubblewrap sandboxes (git, python and pytest run isolated)."""
  sandboxes = pytest.importorskip("sandboxes")
  from rollout.workspace import SandboxFactory
  path, shas = repo
  try:
    factory = SandboxFactory()
  except sandboxes.BackendUnavailableError as e:
    pytest.skip(f"no namespaced sandboxes on this machine: {e}")
  try:
    tasks, rejected = miner.mine(path, environment.EnvironmentCache(factory), FAST)
    assert {t.metadata["commit"] for t in tasks} == {shas["mul"], shas["sub"]}
    assert len(rejected) == 4
  finally:
    factory.close()
