"""The trainer on meshes of 8 fake CPU devices gives the 1-device run's losses and params; bad meshes are errors.

Tolerances: every mesh computes the same float32 math with different reduction orders and shard-local partial
sums, so per-step values differ by rounding (~1e-7 relative). Three AdamW steps amplify that little: Adam's update is
m / (sqrt(v) + eps) and can only move a weight by ~lr (3e-3) per step, so params agree to well under 1e-4 and
losses to 1e-5 relative. A real sharding bug (a missing all-reduce, a wrong slice) changes losses at the 1e-2 level.
"""
import dataclasses

import jax
import numpy as np
import pytest
from mesh_testlib import B, batches, logged, model_config, train

from composer_jax import configs, model
from composer_jax.parallel import layout
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.train import loop, stages
from experiments.configs import pretrain as pretrain_config

STEPS = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The 1-device run: (per-step metrics, final params on the host)."""
  workdir = str(tmp_path_factory.mktemp("ref"))
  params, _ = train(workdir, STEPS, loop.single_device_mesh(), mesh_lib.MeshConfig().rules())
  return logged(workdir), jax.device_get(params)


def _assert_same_run(workdir, params, reference):
  ref_rows, ref_params = reference
  rows = logged(workdir)
  for step in range(1, STEPS + 1):
    for key in ("loss", "ce", "mtp1_loss", "balance_loss"):
      np.testing.assert_allclose(rows[step][key], ref_rows[step][key], rtol=1e-5, err_msg=f"{key} at step {step}")
    assert rows[step]["target_tokens"] == ref_rows[step]["target_tokens"]
  np.testing.assert_allclose(rows[STEPS]["eval_loss"], ref_rows[STEPS]["eval_loss"], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), jax.device_get(params),
               ref_params)


def test_reference_run_uses_the_loss_mask_mtp_and_router_bias(reference):
  rows, params = reference
  data = batches(STEPS)
  for step in range(1, STEPS + 1):
    # Target tokens are the hand-counted masked next-token targets of that batch.
    assert rows[step]["target_tokens"] == data[step - 1]["target_mask"].sum()
    assert np.isfinite(rows[step]["mtp1_loss"]) and rows[step]["mtp1_loss"] > 0
  # Aux-loss-free balancing moved the router biases by whole multiples of the rate (1e-2); 3 steps cannot cancel.
  for bias in (params["moe_layers"]["moe"]["bias"], params["mtp"]["block"]["moe"]["bias"]):
    assert np.abs(bias).max() > 0
    np.testing.assert_allclose(bias / 1e-2, np.round(bias / 1e-2), atol=1e-4)


# Each mesh costs ~30-40 s of compiles on 2 idle cores (one core-minute a run), so the default suite checks meshes
# through the resume test below (data=2 x tensor=4 with FSDP, then data=8 without); these full runs are slow-only.
@pytest.mark.slow
@pytest.mark.parametrize("mesh_cfg", [
    mesh_lib.MeshConfig(data=8, fsdp=False),
    mesh_lib.MeshConfig(data=8, fsdp=True),
    mesh_lib.MeshConfig(data=2, tensor=4, fsdp=True),
], ids=["data8", "data8_fsdp", "data2_tensor4_fsdp"])
def test_mesh_run_matches_one_device(tmp_path, reference, mesh_cfg):
  mesh = mesh_lib.mesh_from_config(mesh_cfg)
  params, _ = train(str(tmp_path), STEPS, mesh, mesh_cfg.rules())
  # The weights really are sharded as configured: FSDP puts the embedding's D dim on `data`.
  embed = params["embed"].sharding.spec
  assert tuple(embed) == ("tensor", "data" if mesh_cfg.fsdp else None)
  _assert_same_run(str(tmp_path), params, reference)


def test_resume_on_another_mesh_than_the_save(tmp_path, reference):
  """Save at step 2 on data=2 x tensor=4 (FSDP), resume on data=8 (no FSDP; orbax reshards): same as 1 device."""
  cfg_a, cfg_b = mesh_lib.MeshConfig(data=2, tensor=4, fsdp=True), mesh_lib.MeshConfig(data=8, fsdp=False)
  params_a, _ = train(str(tmp_path), 2, mesh_lib.mesh_from_config(cfg_a), cfg_a.rules())
  assert tuple(params_a["embed"].sharding.spec) == ("tensor", "data")
  assert params_a["embed"].addressable_shards[0].data.shape == (512 // 4, 32 // 2)
  params, _ = train(str(tmp_path), STEPS, mesh_lib.mesh_from_config(cfg_b), cfg_b.rules())
  assert params["embed"].addressable_shards[0].data.shape == (512, 32)
  _assert_same_run(str(tmp_path), params, reference)


def test_a_mesh_axis_that_does_not_divide_a_dimension_is_named(tmp_path):
  cfg = mesh_lib.MeshConfig(tensor=8)   # the model has 4 heads
  with pytest.raises(ValueError, match=r"'heads', size 4.*tensor=8"):
    train(str(tmp_path), 1, mesh_lib.mesh_from_config(cfg), cfg.rules())


def test_a_batch_the_data_axis_does_not_divide_is_named():
  mesh = mesh_lib.mesh_from_config(mesh_lib.MeshConfig(data=8))
  sharding = layout.batch_sharding(mesh, mesh_lib.MeshConfig().rules())
  layout.check_batch_shape(B, 32, sharding)
  with pytest.raises(ValueError, match=r"global batch size 12 .* data=8"):
    layout.check_batch_shape(12, 32, sharding)


def test_mesh_config_errors_name_the_problem():
  c = pretrain_config.get_config("tiny")
  assert configs.from_dict(stages.StageConfig, c).mesh == mesh_lib.MeshConfig(data=1)
  c.mesh.dtaa = 2
  with pytest.raises(ValueError, match="mesh.dtaa"):
    configs.from_dict(stages.StageConfig, c)
  with pytest.raises(ValueError, match="At most one"):
    mesh_lib.MeshConfig(data=-1, tensor=-1)
  with pytest.raises(ValueError, match="needs 16 devices"):
    mesh_lib.mesh_from_config(mesh_lib.MeshConfig(data=16))
  assert mesh_lib.mesh_from_config(mesh_lib.MeshConfig(data=2, tensor=2)).devices.size == 4   # the first 4 of 8
  assert dict(mesh_lib.mesh_from_config(mesh_lib.MeshConfig(data=-1, tensor=2)).shape)["data"] == 4


def test_process_batch_shard_on_a_fake_two_process_layout():
  """Devices 0-3 on process 0 and 4-7 on process 1: data=4 x tensor=2 splits rows in halves; data=1 shares them."""
  class Dev:
    def __init__(self, i):
      self.id, self.process_index = i, i // 4

  devs = np.array([Dev(i) for i in range(8)])
  rules = mesh_lib.MeshConfig().rules()
  for sizes, want in (({"data": 4, "tensor": 2}, [(0, 2), (1, 2)]), ({"tensor": 8}, [(0, 1), (0, 1)])):
    mesh = jax.sharding.Mesh(devs.reshape([sizes.get(a, 1) for a in mesh_lib.MESH_AXES]), mesh_lib.MESH_AXES)
    sharding = jax.sharding.NamedSharding(mesh, layout.batch_spec(mesh, rules))
    assert [layout.process_batch_shard(sharding, p) for p in (0, 1)] == want
  # An interleaved device order: each process would hold every other row block.
  mesh = jax.sharding.Mesh(devs[[0, 1, 4, 5, 2, 3, 6, 7]].reshape(4, 1, 1, 2), mesh_lib.MESH_AXES)
  with pytest.raises(ValueError, match="contiguous"):
    layout.process_batch_shard(jax.sharding.NamedSharding(mesh, layout.batch_spec(mesh, rules)), 0)


def test_given_init_params_are_placed_on_the_mesh():
  """A start from other params (a previous stage, a Hugging Face checkpoint) lands on the run's shardings."""
  cfg, mesh_cfg = model_config(), mesh_lib.MeshConfig(data=2, tensor=4)
  params = model.init(jax.random.key(0), cfg)   # one device
  shardings = model.shardings(cfg, mesh_lib.mesh_from_config(mesh_cfg), mesh_cfg.rules())
  placed = jax.tree.map(loop._place, params, shardings)
  jax.tree.map(lambda p, s: p.sharding.is_equivalent_to(s, p.ndim) or pytest.fail(f"{p.sharding} != {s}"), placed,
               shardings)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(placed), jax.device_get(params))
  again = jax.tree.map(loop._place, placed, shardings)
  assert all(jax.tree.leaves(jax.tree.map(lambda p, q: p is q, placed, again)))   # already placed: left as is


def test_trainer_runs_expert_and_context_parallel_regions(tmp_path, reference):
  """moe_impl="ep_capacity" + attention_impl="ring" on data=2 x expert=2 x context=2: the trainer sets the mesh the
  shard_map regions read, and (capacity never exceeded: factor 8) the run equals the 1-device dense-attention one."""
  cfg = dataclasses.replace(model_config(), moe_impl="ep_capacity", capacity_factor=8.0, attention_impl="ring")
  mesh_cfg = mesh_lib.MeshConfig(data=2, expert=2, context=2, fsdp=False)
  rules = dataclasses.replace(mesh_cfg.rules(), batch=("data", "expert"))
  params, _ = train(str(tmp_path), STEPS, mesh_lib.mesh_from_config(mesh_cfg), rules, cfg)
  assert tuple(params["moe_layers"]["moe"]["gate"].sharding.spec)[1] == "expert"
  _assert_same_run(str(tmp_path), params, reference)
