"""rollout/tasks/registry.py: one registry of task sources for SFT, RL and evaluation."""

import pytest

from rollout.tasks import procedural, registry, setfile
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import LocalFactory
from tests.tasks_testlib import FAST, commit, init_repo

CALC = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture()
def envs(tmp_path):
  f = LocalFactory(root=str(tmp_path / "ws"))
  yield EnvironmentCache(f)
  f.close()


def test_unknown_kind_split_and_levels_list_the_valid_names(envs):
  with pytest.raises(ValueError, match=r"unknown task source 'minde'; valid: \['file', 'mined', 'procedural'"):
    registry.SetSpec("minde")
  with pytest.raises(ValueError, match="unknown split 'test'"):
    registry.SetSpec("procedural", split="test")
  with pytest.raises(ValueError, match=r"unknown procedural levels \[7\]; valid: \[1, 2, 3, 4\]"):
    registry.load_tasks(registry.SetSpec("procedural", n=2, split="train", levels=(1, 7)), envs)
  with pytest.raises(ValueError, match="split='train' or 'heldout'"):
    registry.load_tasks(registry.SetSpec("procedural", n=2), envs)
  with pytest.raises(ValueError, match="needs repos"):
    registry.load_tasks(registry.SetSpec("mined"), envs)
  with pytest.raises(ValueError, match="needs jsonl and repos_dir"):
    registry.load_tasks(registry.SetSpec("swe"), envs)
  with pytest.raises(ValueError, match="no set file given"):
    registry.load_tasks(registry.SetSpec("file"), envs)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    registry.load_tasks(registry.SetSpec("file", path="nope.json"), envs)


def test_procedural_level_mix_keeps_train_and_heldout_cores_disjoint(envs):
  mix = dict(levels=(1, 2, 3), seed=5)
  train = registry.load_tasks(registry.SetSpec("procedural", n=60, split="train", **mix), envs)
  held = registry.load_tasks(registry.SetSpec("procedural", n=30, split="heldout", **mix), envs)
  assert [t.metadata["level"] for t in held[:6]] == [1, 2, 3, 1, 2, 3]  # interleaved: any prefix is a mix
  assert {lv: sum(t.metadata["level"] == lv for t in held) for lv in (1, 2, 3)} == {1: 10, 2: 10, 3: 10}
  train_cores = {c for t in train for c in t.metadata["cores"]}
  held_cores = {c for t in held for c in t.metadata["cores"]}
  assert train_cores and held_cores and not train_cores & held_cores
  # The same tasks the generator makes for one level (the registry adds nothing of its own).
  one = registry.load_tasks(registry.SetSpec("procedural", n=4, split="heldout", levels=(2,), seed=5), envs)
  assert [t.id for t in one] == [t.id for t in procedural.generate(4, seed=5, split="heldout", level=2)]


def test_file_source_split_and_n(tmp_path, envs):
  tasks = procedural.generate(40, seed=1, split="train", level=1)
  dicts = [t.to_dict() for t in tasks]
  path = str(tmp_path / "s.json")
  setfile.write_set(path, {"format": setfile.FORMAT, "name": "s", "version": "1", "tasks": dicts,
                           "sha256": setfile.tasks_digest(dicts)})
  every = registry.load_tasks(registry.SetSpec("file", path=path), envs, log=lambda s: None)
  assert [t.id for t in every] == [t.id for t in tasks]
  train = registry.load_tasks(registry.SetSpec("file", path=path, split="train"), envs, log=lambda s: None)
  held = registry.load_tasks(registry.SetSpec("file", path=path, split="heldout"), envs, log=lambda s: None)
  assert sorted(t.id for t in train + held) == sorted(t.id for t in tasks) and held and train
  assert {t.id for t in held} == {t.id for t in tasks if registry.split_of(t, 20) == "heldout"}
  assert len(registry.load_tasks(registry.SetSpec("file", path=path, n=3), envs, log=lambda s: None)) == 3


def test_mined_source_from_a_relative_path(tmp_path, envs, monkeypatch):
  repo = tmp_path / "r"
  init_repo(repo)
  commit(repo, {"calc.py": "def sub(a, b):\n    return a - b\n", "tests/test_calc.py": "def test_x():\n  pass\n"},
         "Initial")
  commit(repo, {"calc.py": "def sub(a, b):\n    return a - b\n\n\ndef add(a, b):\n    return a + b\n",
                "tests/test_calc.py": TEST}, "Add add for sums")
  monkeypatch.chdir(tmp_path)
  tasks = registry.load_tasks(registry.SetSpec("mined", repos=["r"], miner=FAST), envs, log=lambda s: None)
  assert [t.prompt for t in tasks] == ["Add add for sums"]
  assert tasks[0].environment.repo == str(repo)  # stored absolute: the set works from any directory


def test_register_a_new_family(envs):
  @registry.register("just_one")
  def _load(spec, envs, log):
    return procedural.generate(1, seed=spec.seed, split="train")
  try:
    assert len(registry.load_tasks(registry.SetSpec("just_one"), envs)) == 1
    with pytest.raises(ValueError, match="already registered"):
      registry.register("just_one")(_load)
  finally:
    del registry.SOURCES["just_one"]


def test_set_names_say_what_the_set_is():
  assert registry.SetSpec("procedural", n=8, split="heldout", levels=(1, 2)).name == "procedural-L1+2-heldout"
  assert registry.SetSpec("mined", repos=("/src/attrs/", "b")).name == "mined-attrs+b"
  assert registry.SetSpec("file", path="sets/attrs_v1.json", split="heldout").name == "attrs_v1-heldout"
  assert registry.SetSpec("swe", jsonl="x/lite.jsonl", n=5).name == "swe-lite-n5"
