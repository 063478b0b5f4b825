"""`train.step.state_shardings`: optimizer moments follow their params' shardings on a mesh (not replicated)."""
import math

import jax
from jax.sharding import PartitionSpec as P

from composer_jax import configs, model
from composer_jax.parallel import make_mesh
from composer_jax.parallel.rules import ShardingRules
from composer_jax.train import optim
from composer_jax.train import step as step_lib
from composer_jax.train.config import OptimConfig
from experiments.configs import model as model_configs


def _per_device(tree) -> int:
  return sum(math.prod(s.data.shape) * s.data.dtype.itemsize for x in jax.tree.leaves(tree)
             for s in x.addressable_shards if s.device == jax.devices()[0])


def test_moments_mirror_params_and_scalars_replicate():
  cfg = configs.from_dict(model.ModelConfig, model_configs.get_config("tiny").to_dict())
  mesh = make_mesh({"data": 2, "expert": 4})
  rules = ShardingRules(batch=("data", "expert"))
  p_shard = model.shardings(cfg, mesh, rules)
  abstract = model.abstract_params(cfg)
  opt = optim.make_optimizer(OptimConfig(), abstract)
  shardings = step_lib.state_shardings(opt, abstract, p_shard)
  adam = shardings.opt_state.inner_states["train"].inner_state[1][0]
  want = {jax.tree_util.keystr(k): s.spec for k, s in jax.tree_util.tree_flatten_with_path(p_shard)[0]}
  for moments in (adam.mu, adam.nu):
    got = {jax.tree_util.keystr(k): s.spec for k, s in jax.tree_util.tree_flatten_with_path(moments)[0]}
    assert len(got) == len(want) - 2            # the two router biases are frozen: no moments
    assert all(spec == want[k] for k, spec in got.items())
  assert adam.mu["moe_layers"]["moe"]["gate"].spec == P(None, "expert", None, "tensor")
  assert shardings.step.spec == P()
  # Materialised: each device holds its shard of the moments, i.e. 2x its share of the (f32) params.
  params = model.init(jax.random.key(0), cfg, mesh, rules)
  state = jax.jit(lambda p: step_lib.init_state(p, opt), out_shardings=shardings)(params)
  adam_state = state.opt_state.inner_states["train"].inner_state[1][0]
  trained = {k: v for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]
             if not jax.tree_util.keystr(k).endswith("['bias']")}
  assert _per_device(adam_state.mu) == _per_device(adam_state.nu) == _per_device(list(trained.values()))
