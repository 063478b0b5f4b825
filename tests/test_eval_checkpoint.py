"""composer_jax/eval_policies.py reads both checkpoint layouts (LM-stage orbax export, RL-run published npz) back to
the params that were saved, and names the problem when a workdir holds neither or the config does not match."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from composer_jax import configs, eval_policies
from composer_jax.model import params as params_lib
from composer_jax.model.config import ModelConfig
from composer_jax.train import stages
from experiments.configs import model as model_configs

CFG = configs.from_dict(ModelConfig, model_configs.get_config("tiny").to_dict())


@pytest.fixture(scope="module")
def params():
  """Random leaves of the model's abstract shapes (no initialiser compile: the loader only moves arrays)."""
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), params_lib.abstract_params(CFG))


def _assert_same(a, b):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (_, x), (_, y) in zip(la, lb, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_stage_export_round_trip(tmp_path, params):
  stages.export_params(str(tmp_path), params)
  got, version = eval_policies.load_checkpoint_params(str(tmp_path), CFG)
  _assert_same(got, params)
  assert version == 0


def test_rl_published_npz_round_trip(tmp_path, params):
  # The layout composer_jax/rl/weight_files.py writes: leaves by keystr path, latest.json pointing at v<version>.npz.
  wdir = tmp_path / "weights"
  wdir.mkdir()
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  np.savez(wdir / "v7.npz", **flat)
  (wdir / "latest.json").write_text(json.dumps({"version": 7, "path": "v7.npz"}))
  got, version = eval_policies.load_checkpoint_params(str(tmp_path), CFG)
  _assert_same(got, params)
  assert version == 7
  bigger = dataclasses.replace(CFG, hidden_size=CFG.hidden_size * 2)
  with pytest.raises(ValueError, match="shape"):
    eval_policies.load_checkpoint_params(str(tmp_path), bigger)


def test_empty_workdir_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="neither"):
    eval_policies.load_checkpoint_params(str(tmp_path), CFG)
