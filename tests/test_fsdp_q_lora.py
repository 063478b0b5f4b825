"""FSDP of q_b's input dim (`ShardingRules.q_lora_in`, as the scale plan splits it over context): q_b is sharded as
the rule says, and the model's loss and every gradient on 8 fake devices equal the one-device run."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import configs, model
from composer_jax.model import head
from composer_jax.parallel import make_mesh
from composer_jax.parallel.rules import ShardingRules, use_rules
from experiments.configs import model as model_configs

# q_a splits its D over `data` (FSDP); q_b its q_lora input over `data` too, which one rule for both would refuse.
RULES = ShardingRules(batch="expert", embed="data", q_lora_in="data")


def _loss(params, tokens, cfg):
  h, _ = model.hidden_states(params, tokens, cfg)
  targets = jnp.roll(tokens, -1, axis=1)
  return head.cross_entropy(h, model.lm_head(params, cfg), targets, jnp.ones_like(tokens))[0]


def test_q_b_split_over_its_input_matches_one_device():
  cfg = configs.from_dict(model.ModelConfig, model_configs.get_config("tiny").to_dict())
  cfg = dataclasses.replace(cfg, q_lora_rank=32, compute_dtype="float32", param_dtype="float32")
  params = model.init(jax.random.key(0), cfg)
  tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, cfg.vocab_size)
  grad = jax.jit(jax.value_and_grad(_loss), static_argnums=2)
  loss1, g1 = grad(params, tokens, cfg)

  mesh = make_mesh({"data": 4, "expert": 2})
  shardings = model.shardings(cfg, mesh, RULES)
  q_b = jax.tree_util.tree_flatten_with_path(shardings)[0]
  q_b = next(s for k, s in q_b if "q_b" in jax.tree_util.keystr(k))
  assert q_b.spec[1] == "data", q_b.spec                 # [layers, q_lora, heads, head_dim]: q_lora over data
  with jax.set_mesh(mesh), use_rules(RULES):
    loss8, g8 = grad(jax.device_put(params, shardings), jax.device_put(tokens, NamedSharding(mesh, P("expert"))),
                     cfg)
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g8)[0], jax.tree.leaves(g1)):
    # f32 sums over other devices in another order.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
