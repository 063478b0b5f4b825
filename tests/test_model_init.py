"""`model.init`: one random draw for every normal leaf, honouring initializer_range; norms ones, biases zeros."""
import dataclasses

import jax
import numpy as np

from composer_jax import model
from composer_jax.model import params as params_lib

CFG = model.ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_nextn_predict_layers=1,
                        q_lora_rank=8)


def test_one_random_op_for_all_normal_leaves():
  jaxpr = str(jax.make_jaxpr(lambda k: params_lib.init_values(k, CFG))(jax.random.key(0)))
  assert jaxpr.count("random_bits") == 1, jaxpr.count("random_bits")


def test_values_follow_the_description():
  cfg = dataclasses.replace(CFG, initializer_range=0.5)
  p = model.init(jax.random.key(1), cfg)
  specs = model.param_specs(cfg)
  flat = jax.tree_util.tree_flatten_with_path(p)[0]
  info = dict(jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, model.ArrayInfo))[0])
  normals = []
  for path, a in flat:
    init = info[path].initializer
    assert a.shape == info[path].shape and a.dtype == info[path].dtype
    if isinstance(init, params_lib.Constant):
      np.testing.assert_array_equal(a, init.value)
    else:
      assert init.std == 0.5
      normals.append(np.asarray(a).ravel())
  z = np.concatenate(normals) / 0.5
  assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02
  # Leaves are different slices of the draw, not copies of each other.
  assert len({float(v[0]) for v in normals}) == len(normals)
  # A different key gives different weights.
  q = model.init(jax.random.key(2), cfg)
  assert not np.allclose(p["embed"], q["embed"])


def test_large_leaves_get_their_own_draws(monkeypatch):
  monkeypatch.setattr(params_lib, "MAX_DRAW", 1000)
  leaves = jax.tree.leaves(model.param_specs(CFG), is_leaf=lambda x: isinstance(x, model.ArrayInfo))
  groups = params_lib._draw_groups(leaves)
  for g in groups:
    sizes = [int(np.prod(leaves[i].shape)) for i in g]
    assert len(g) == 1 or sum(sizes) <= 1000
  assert sorted(i for g in groups for i in g) == [i for i, a in enumerate(leaves)
                                                    if isinstance(a.initializer, params_lib.Normal)]
