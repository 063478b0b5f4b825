"""RL (and its SFT warm start) on any task source of the registry: a small mined set from a git repository the test
builds. Mined tasks have no scripted oracle, so the warm start's demonstrations apply their gold patches."""
import json

import pytest

from composer_jax import configs
from composer_jax.rl import loop, setup
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs
from tests.tasks_testlib import FAST, commit, init_repo


def _mined_repo(path):
  """Three commits, each adding a function with its test: two mineable tasks (the first commit is the base; the
  subjects have the three words a self-contained prompt needs)."""
  init_repo(path)
  commit(path, {"calc.py": "def one():\n    return 1\n", "tests/test_one.py": "def test_one():\n    pass\n"}, "Start")
  commit(path, {"calc.py": "def one():\n    return 1\n\n\ndef two():\n    return 2\n",
                "tests/test_two.py": "from calc import two\n\n\ndef test_two():\n    assert two() == 2\n"},
         "Add two to calc")
  commit(path, {"calc.py": "def one():\n    return 1\n\n\ndef two():\n    return 2\n\n\ndef six():\n    return 6\n",
                "tests/test_six.py": "from calc import six\n\n\ndef test_six():\n    assert six() == 6\n"},
         "Add six to calc")
  return str(path)


@pytest.mark.slow   # ~105 s on the loaded 2-core machine: mining runs pytest twice per side of each commit
def test_sync_rl_on_a_mined_set_with_gold_patch_demonstrations(tmp_path):
  repo = _mined_repo(tmp_path / "repo")
  c = rl_configs.get_config(f"test,mode=sync,tasks=mined,repos={repo}")
  assert c.tasks.kind == "mined" and c.tasks.n == 0
  cfg = configs.from_dict(RunConfig, c, workdir=str(tmp_path / "run"))
  # A gold-patch turn (write_file of a unified diff) is longer than a procedural edit: room for it.
  cfg = configs.replace(cfg, **{"tasks.miner": FAST, "tasks.heldout_percent": 1, "train.steps": 2,
                                "train.ckpt_every": 2, "harness.context_budget": 1000, "harness.max_turn_tokens": 400,
                                "harness.summary_max_tokens": 400, "harness.tools.max_output_chars": 200,
                                "sft.seq_len": 512})
  out = loop.train_rl(cfg, log_fn=lambda s: None)
  pool = setup.train_pool(cfg)
  assert sorted(t.prompt for t in pool) == ["Add six to calc", "Add two to calc"]
  assert (tmp_path / "run" / "tasks_train_0.json").exists()      # frozen once: workers read the same pool
  demos = [json.loads(line)["messages"] for line in open(tmp_path / "run" / "sft" / "sft_train.jsonl")]
  calls = [c for m in demos for turn in m if turn["role"] == "assistant" for c in turn.get("tool_calls") or []]
  patches = [c["arguments"]["content"] for c in calls if c["name"] == "write_file"]
  assert len(patches) == len(demos) == 2 and all(p.startswith("diff --git") for p in patches)
  assert sorted(t.gold_patch for t in pool) == sorted(patches)    # the demonstrations are the gold patches
  applied = [json.loads(line) for line in open(tmp_path / "run" / "applied.jsonl")]
  assert [r["step"] for r in applied] == [1, 2] and int(out["last"]["step"]) == 2
  assert all(len(r["keys"]) == cfg.train.groups_per_step for r in applied)


def test_file_task_source_from_the_command_line_arg():
  c = rl_configs.get_config("colab,tasks=file,set_file=sets/x_v1.json")
  cfg = configs.from_dict(RunConfig, c, workdir="/tmp/unused")
  assert (cfg.tasks.kind, cfg.tasks.path, cfg.tasks.split, cfg.sft.demo_accuracy) == ("file", "sets/x_v1.json",
                                                                                       "train", 1.0)
  assert setup.heldout_spec(cfg).split == "heldout" and setup.heldout_spec(cfg).n == cfg.eval.tasks
  mix = configs.from_dict(RunConfig, rl_configs.get_config("colab,levels=1+2"), workdir="/tmp/unused")
  assert mix.tasks.levels == (1, 2) and mix.tasks.seed == mix.seed + 1


def test_a_finite_pool_is_frozen_once_and_checked_against_the_config(tmp_path):
  from rollout.tasks import procedural, registry
  calls = []

  @registry.register("rl_test_source")
  def _load(spec, envs, log):
    calls.append(spec.split)
    return procedural.generate(12, seed=3, split="train")
  try:
    cfg = configs.from_dict(RunConfig, rl_configs.get_config("test"), workdir=str(tmp_path))
    cfg = configs.replace(cfg, **{"tasks.kind": "rl_test_source", "tasks.n": 0})
    pool = setup.train_pool(cfg)
    assert [t.id for t in setup.train_pool(cfg)] == [t.id for t in pool] and calls == ["train"]   # read back
    held = setup.heldout_tasks(cfg)
    assert {t.id for t in held}.isdisjoint(t.id for t in pool) and len(held) + len(pool) == 12
    other = configs.replace(cfg, **{"tasks.heldout_percent": 50})
    with pytest.raises(ValueError, match=r"another task source \{'heldout_percent': \(20, 50\)\}"):
      setup.train_pool(other)
  finally:
    del registry.SOURCES["rl_test_source"]
