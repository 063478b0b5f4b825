"""The embedded engine on a mesh of 8 fake devices keeps the conventions the RL trainer relies on.

The conventions' own test (`test_sampling_engine.py`: logprobs and routing equal the trainer's forward on the same
tokens, stop tokens and lengths as asked) runs here again with this module's `engine` fixture: the weights as the
trainer holds them on data=2 x expert=2 x context=2 (FSDP), and replicas over the 8 devices with the rows split.
"""
import dataclasses

import jax
import numpy as np
import pytest
from test_sampling_engine import CFG, ECFG, _requests
from test_sampling_engine import test_outputs_match_trainer_forward as test_outputs_match_trainer_forward  # noqa: F401

from composer_jax import model
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.rl import placement as rl_placement
from composer_jax.sampling.engine import JaxEngine

MESH = mesh_lib.MeshConfig(data=2, expert=2, context=2)


@pytest.fixture(scope="module")
def params():
  return model.init(jax.random.key(0), dataclasses.replace(CFG, initializer_range=0.2))


@pytest.fixture(scope="module")
def trained(params):
  """The params as the RL trainer places them on the mesh."""
  mesh = mesh_lib.mesh_from_config(MESH)
  return mesh, rl_placement.place_tree(params, model.shardings(CFG, mesh, MESH.rules()))


@pytest.fixture(scope="module", params=["trainer", "replicas"])
def engine(request, trained):
  mesh, on_mesh = trained
  return JaxEngine(on_mesh, CFG, ECFG, mesh=mesh, placement=request.param)


def test_weights_stay_where_the_placement_says(engine, trained):
  mesh, on_mesh = trained
  embed = engine.params["embed"]
  if engine.placement == "trainer":
    assert embed is on_mesh["embed"]                              # the trainer's arrays: no copy
  else:
    assert embed.sharding.is_fully_replicated and len(embed.sharding.device_set) == mesh.size


def test_a_weight_update_moves_between_devices_only(engine, trained):
  """From the trainer's shardings to the engine's: device to device, never through the host."""
  _, on_mesh = trained
  before = jax.tree.map(lambda x: x.sharding, engine.params)
  newer = jax.tree.map(lambda x: x * 1.5, on_mesh)
  with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
    engine.update_weights(newer, policy_version=engine.policy_version + 1)
  assert jax.tree.map(lambda x: x.sharding, engine.params) == before
  np.testing.assert_array_equal(engine.params["embed"], np.asarray(newer["embed"]))
  engine.update_weights(on_mesh, policy_version=engine.policy_version - 1)


def test_same_tokens_as_one_device(engine, params):
  """Seeded requests give the same tokens, logprobs and routing as the engine on one device (logprobs to 1e-5: the
  same float32 math summed in another order, ~1e-6 seen; a token or expert choice would only flip at a tie)."""
  reqs = _requests(2)
  single = JaxEngine(params, CFG, ECFG).generate(reqs)
  for got, want in zip(engine.generate(reqs), single):
    np.testing.assert_array_equal(got.output_ids, want.output_ids)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
