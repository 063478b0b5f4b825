"""rollout/tasks/swe.py: SWE-bench-style JSONL instances against a local repository copy, graded offline."""

import json
import subprocess

import pytest

from rollout.tasks import environment, swe
from rollout.workspace import LocalFactory

SRC = "def clamp(x, lo, hi):\n    return max(lo, x)\n"
FIXED = "def clamp(x, lo, hi):\n    return min(hi, max(lo, x))\n"
TESTS = "from mod import clamp\n\n\ndef test_low():\n    assert clamp(-1, 0, 5) == 0\n"
NEW_TESTS = TESTS + "\n\ndef test_high():\n    assert clamp(9, 0, 5) == 5\n"


def _git(repo, *args):
  return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                        capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
  root = tmp_path_factory.mktemp("repos")
  repo = root / "acme__clampy"
  repo.mkdir()
  _git(repo, "init", "-q")
  (repo / "mod.py").write_text(SRC)
  (repo / "test_mod.py").write_text(TESTS)
  _git(repo, "add", "-A")
  _git(repo, "commit", "-qm", "base")
  base = _git(repo, "rev-parse", "HEAD").strip()
  (repo / "mod.py").write_text(FIXED)
  patch = _git(repo, "diff")
  _git(repo, "checkout", "-q", "--", "mod.py")
  (repo / "test_mod.py").write_text(NEW_TESTS)
  test_patch = _git(repo, "diff")
  _git(repo, "checkout", "-q", "--", "test_mod.py")
  inst = {"instance_id": "acme__clampy-1", "repo": "acme/clampy", "base_commit": base, "patch": patch,
          "test_patch": test_patch, "FAIL_TO_PASS": json.dumps(["test_mod.py::test_high"]),
          "PASS_TO_PASS": ["test_mod.py::test_low"], "problem_statement": "clamp ignores hi"}
  path = root / "instances.jsonl"
  path.write_text(json.dumps(inst) + "\n\n")
  return str(path), str(root), inst


def test_load_and_grade(instance, tmp_path):
  path, repos, _ = instance
  fast = {"acme/clampy": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " + swe.DEFAULT_TEST_COMMAND}  # halves pytest start-up
  (task,) = swe.load_jsonl(path, repos, test_commands=fast)
  assert task.id == "swe/acme__clampy-1" and task.prompt == "clamp ignores hi"
  assert task.tests.fail_to_pass == ("test_mod.py::test_high",) and task.metadata["changed_files"] == ["mod.py"]
  assert task.metadata["changed_lines"] == 2
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path)))
  ws = envs.fork(task)
  assert ws.read_file("mod.py") == SRC and ws.exists(".git")
  before = environment.grade(ws, task.tests)
  ws.close()
  assert before.results == {"test_mod.py::test_high": "FAILED", "test_mod.py::test_low": "PASSED"}
  ws = envs.fork(task)
  assert environment.apply_patch(ws, task.gold_patch).ok
  assert environment.grade(ws, task.tests).passed
  ws.close()


def test_errors_name_the_problem(instance, tmp_path):
  path, repos, inst = instance
  with pytest.raises(FileNotFoundError, match="no local clone of 'acme/clampy'"):
    swe.load_jsonl(path, str(tmp_path))
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({k: v for k, v in inst.items() if k != "patch"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: instance acme__clampy-1: missing fields \['patch'\]"):
    swe.load_jsonl(str(bad), repos)
  bad.write_text(json.dumps({**inst, "FAIL_TO_PASS": "[oops"}) + "\n")
  with pytest.raises(ValueError, match="FAIL_TO_PASS is a string but not a JSON list"):
    swe.load_jsonl(str(bad), repos)


def test_relative_repos_dir_is_stored_absolute(instance, monkeypatch):
  import os
  path, repos, _ = instance
  monkeypatch.chdir(os.path.dirname(repos))
  (task,) = swe.load_jsonl(path, os.path.basename(repos))
  assert task.environment.repo == os.path.join(repos, "acme__clampy")  # the set works from any directory
