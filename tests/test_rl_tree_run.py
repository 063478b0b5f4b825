"""Tree groups through the RL run: `rollout.tree_branch_turns` / `tree_fanouts` reach the workers and the trainer,
and a sync run on the tiny test model trains on tree groups (each leaf's tree record in the queue, every group
applied once, finite losses). The pieces (credit, batches, forks, storage) have their own tests: tests/test_tree*.py."""
import json
import os

import numpy as np
import pytest

from composer_jax import configs
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.rl import loop, placement
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs
from rollout import tree_harness


def _cfg(tmp_path, **overrides):
  base = configs.from_dict(RunConfig, rl_configs.get_config("test,mode=sync,samples=4"), workdir=str(tmp_path))
  return configs.replace(base, **overrides)


def test_a_tree_whose_leaves_are_not_the_group_size_is_refused(tmp_path):
  with pytest.raises(ValueError, match=r"tree_fanouts=\(2, 3\) give 6 leaves per group, but .*samples_per_prompt=4"):
    _cfg(tmp_path, **{"rollout.tree_branch_turns": (0, 1), "rollout.tree_fanouts": (2, 3)})


def test_entropy_branch_points_reach_the_tree_config(tmp_path):
  tree = {"rollout.tree_branch_turns": (0, 3), "rollout.tree_fanouts": (2, 2)}
  assert _cfg(tmp_path, **tree).rollout.tree.branch_entropy is None
  cfg = _cfg(tmp_path, **tree, **{"rollout.tree_branch_entropy": 1.5})
  assert cfg.rollout.tree == tree_harness.TreeConfig((0, 3), (2, 2), branch_entropy=1.5)
  with pytest.raises(ValueError, match="branch_entropy must be > 0"):
    _cfg(tmp_path, **tree, **{"rollout.tree_branch_entropy": -1.0})


def test_shared_prefixes_reach_the_batch_and_the_step_and_need_trees(tmp_path):
  with pytest.raises(ValueError, match="rl.share_prefix stores a tree group's shared prefix once, but the groups are "
                                       "flat"):
    _cfg(tmp_path, **{"rl.share_prefix": True})
  cfg = _cfg(tmp_path, **{"rl.share_prefix": True, "rollout.tree_branch_turns": (0, 1), "rollout.tree_fanouts": (2, 2)})
  assert placement.batch_config(cfg).share_prefix
  mesh, rules = mesh_lib.mesh_from_config(cfg.mesh), cfg.mesh.rules()
  assert {"token_adv", "branch", "branch_end", "prev"} <= set(placement.build_rl_step(cfg, mesh, rules).batch)
  flat = placement.build_rl_step(_cfg(tmp_path), mesh, rules)
  assert not {"token_adv", "branch"} & set(flat.batch)


@pytest.mark.slow   # a warm start and two RL steps: minutes on a loaded 2-core machine
@pytest.mark.parametrize("share_prefix", [False, True])
def test_a_sync_run_trains_on_tree_groups(tmp_path, monkeypatch, share_prefix):
  trees, real = [], tree_harness.rollout_tree

  def spy(*args):
    leaves = real(*args)
    trees.append([t.tree for t in leaves])
    return leaves

  monkeypatch.setattr(tree_harness, "rollout_tree", spy)
  cfg = _cfg(tmp_path, **{"rl.steps": 2, "rollout.tree_branch_turns": (0, 1), "rollout.tree_fanouts": (2, 2),
                          "rl.share_prefix": share_prefix})
  out = loop.run_rl(cfg, log_fn=lambda s: None)
  assert int(out["last"]["step"]) == 2
  assert len(trees) >= 2 * cfg.rl.groups_per_step and all(sum(t["multiplicity"] for t in g) == 4 for g in trees)
  applied = [json.loads(line) for line in open(os.path.join(tmp_path, "applied.jsonl"))]
  keys = [k for r in applied for k in r["keys"]]
  assert [r["step"] for r in applied] == [1, 2] and len(keys) == len(set(keys)) == 2 * cfg.rl.groups_per_step
  m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert all(np.isfinite(r["loss"]) for r in m if "loss" in r)
