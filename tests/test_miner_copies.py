"""rollout/tasks/copies.py: a copy of the mined project that the workspace's interpreter can read (here the real
`more_itertools` that setuptools bundles in this venv) dates the history: commits older than the copy are refused
(the copy would show the agent their future), later ones are mined; a same-named project that shares no file
version with the history decides nothing; gold validation applies the same rule to a set mined elsewhere."""

import os

import pytest
import setuptools

from rollout.evaluation import gold
from rollout.evaluation.gold_cache import GoldCache
from rollout.tasks import copies, environment, miner
from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import LocalFactory
from tests.tasks_testlib import FAST, commit, git, init_repo, sandbox_factory

VENDORED = os.path.join(os.path.dirname(setuptools.__file__), "_vendor", "more_itertools")
TEST = "from more_itertools import first\n\n\ndef test_first():\n    assert first([3, 4]) == 3\n"


def _vendored_files() -> dict[str, str]:
  return {f"more_itertools/{name}": open(os.path.join(VENDORED, name)).read()
          for name in sorted(os.listdir(VENDORED)) if os.path.isfile(os.path.join(VENDORED, name))}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
  if not os.path.isdir(VENDORED):
    pytest.skip(f"this setuptools bundles no more_itertools ({VENDORED})")
  path = tmp_path_factory.mktemp("more_itertools")
  init_repo(path)
  shas = {"root": commit(path, {"more_itertools/__init__.py": "from .more import first\n",
                                "more_itertools/more.py": "def first(it):\n    return it[1]\n",
                                "tests/test_more.py": "def test_nothing():\n    pass\n"}, "Start the package")}
  shas["old_fix"] = commit(path, {"more_itertools/more.py": "def first(it):\n    return next(iter(it))\n",
                                  "tests/test_more.py": TEST}, "first returns the second item")
  shas["release"] = commit(path, {**_vendored_files(), "tests/test_more.py": TEST + "\n\ndef test_last():\n"
                                  "    from more_itertools import last\n    assert last([3, 4]) == 4\n"},
                           "Grow the package to what setuptools bundles")
  later = _vendored_files()["more_itertools/recipes.py"] + "\n\ndef triple_all(xs):\n    return [3 * x for x in xs]\n"
  test_later = TEST + "\n\ndef test_triple():\n    from more_itertools.recipes import triple_all\n" \
    "    assert triple_all([1]) == [3]\n"
  shas["later"] = commit(path, {"more_itertools/recipes.py": later, "tests/test_more.py": test_later},
                         "Add triple_all to the recipes")
  return str(path), shas


def test_project_names(tmp_path):
  init_repo(tmp_path)
  commit(tmp_path, {"pkg/__init__.py": "", "src/other/__init__.py": "", "single.py": "", "setup.py": "",
                    "conftest.py": "", "test_x.py": "", "docs/conf.py": "", "pkg/sub/__init__.py": "",
                    "tests/__init__.py": "", "docs/__init__.py": ""}, "tree")
  assert copies.project_names(str(tmp_path)) == {"pkg": "pkg", "other": "src/other", "single": "single.py"}


def test_commits_older_than_a_bundled_copy_are_refused(repo, tmp_path):
  path, shas = repo
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  tasks, rejected = miner.mine(path, envs, FAST, log=lambda s: None)
  reasons = {r.commit: r.reason for r in rejected}
  for key, parent in (("old_fix", "root"), ("release", "old_fix")):
    assert reasons[shas[key]].startswith("a readable copy of the project is newer than the parent (")
    assert "/_vendor/more_itertools/" in reasons[shas[key]] and f"made after {shas[parent][:12]})" in reasons[shas[key]]
  assert [t.metadata["commit"] for t in tasks] == [shas["later"]]  # the copy is no newer than its parent
  assert tasks[0].tests.fail_to_pass == ("tests/test_more.py::test_triple",)


def test_a_same_named_project_decides_nothing(tmp_path):
  init_repo(tmp_path)
  first = commit(tmp_path, {"more_itertools/__init__.py": "X = 1\n"}, "Start")
  commit(tmp_path, {"more_itertools/__init__.py": "X = 2\n"}, "Grow")
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  found = copies.find(str(tmp_path), envs)
  assert found.placed == () and found.newer_than(first) is None


def test_the_sandbox_interpreter_shows_the_bundled_copy(repo):
  """The same probe inside a bubblewrap sandbox, which binds the venv read-only: the copy is found there too."""
  path, shas = repo
  factory = sandbox_factory()
  try:
    found = copies.find(path, environment.EnvironmentCache(factory))
  finally:
    factory.close()
  assert any(p.copy_path.startswith(os.path.realpath(VENDORED) + "/") for p in found.placed)
  assert found.newer_than(shas["root"]) is not None and found.newer_than(shas["release"]) is None


def test_gold_validation_refuses_a_task_older_than_a_readable_copy(repo, tmp_path):
  """A set mined where no copy was readable, evaluated where one is: gold validation checks this interpreter."""
  path, shas = repo
  gold_patch = git(path, "diff", shas["root"], shas["old_fix"], "--", "more_itertools")
  task = Task("miner/more_itertools/old_fix", "python", "first returns the second item",
              Environment(repo=path, commit=shas["root"]),
              HiddenTests(FAST.test_command.format(files="tests/test_more.py"), ("tests/test_more.py::test_first",),
                          files={"tests/test_more.py": TEST}), gold_patch=gold_patch)
  envs = environment.EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  _, checks = gold.validate([task], envs, progress=False, cache=GoldCache(str(tmp_path / "cache")))
  assert not checks[0].valid and checks[0].reason.startswith("a readable copy of the project is newer than the parent")
