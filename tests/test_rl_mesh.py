"""The RL step on a mesh of 8 fake devices equals the 1-device step; the step carries its rules; bad meshes are named.

Tolerance: the mesh computes the same float32 math in another reduction order (partial sums per shard, then
all-reduces), ~1e-7 relative per value. Three AdamW steps at the RL learning rate (3e-4, gradients clipped to norm 1)
move a weight by at most ~lr per step, whatever the gradient's rounding, so params agree to well under 1e-5 and
metrics to 1e-5 relative, or 1e-6 absolute for those that are differences of logprobs of size ~4 (the KL, the policy
loss: float32 spacing there is ~5e-7, and the difference can be near 0); a sharding bug (a missing all-reduce, a wrong
slice, a replicated per-sequence field read as sharded) moves losses at the 1e-2 level. Routing compares exactly: the
top-k choices only flip at ties, and these random weights have none within rounding.
"""
import dataclasses

import jax
import numpy as np
import pytest

from composer_jax import model
from composer_jax.parallel import layout
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.parallel.rules import ShardingRules, use_rules
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import placement
from composer_jax.rl import step as rl_step_lib
from composer_jax.rl.config import RLConfig
from composer_jax.train import loop as train_loop
from tests import tree_testlib as tl
from tests.test_tree import NODES, REWARDS

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        first_k_dense_replace=1, num_nextn_predict_layers=0, initializer_range=0.2)
LM, K, ROWS, LENGTH, STEPS = 1, 2, 8, 16, 3
BCFG = rl_batch.BatchConfig(rows=ROWS, length=LENGTH, n_moe_layers=LM, top_k=K)
MESH = mesh_lib.MeshConfig(data=2, expert=2, context=2)
COMPARED = ("loss", "pg_loss", "kl", "entropy", "grad_norm", "update_norm", "param_norm", "logprob_gap_replay",
            "logprob_gap_no_replay", "importance_ratio_mean", "reward", "advantage_abs_mean")


def batches() -> list[dict]:
  """A tree group (its leaves share prefixes: `token_adv`, `loss_weight`) and a flat one per step, engine routing
  recorded for every token but, in the second step, the first row's prompt (filled by the unreplayed pass)."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    flat = tl.flat_group([list(rng.integers(0, tl.ENV, rng.integers(2, 10))) for _ in range(4)],
                         rng.integers(0, 2, 4).astype(float), n_layers=LM)
    tree = tl.tree_group(NODES, REWARDS, n_layers=LM)
    out.append(rl_batch.make_batch([tree, flat], BCFG, staleness=[1, 0]))
  for b in out:
    assert (b["routing"][:, b["segment_ids"] > 0] >= 0).all() and "token_adv" in b
  out[1]["routing"][:, 0, :len(tl.PROMPT)] = -1
  return out


def run(mesh, rules, cfg=CFG):
  """STEPS RL steps from the same start; (metrics per step, params after step 1, params at the end) on the host."""
  step = placement.build_step(cfg, RLConfig(), mesh, rules, rows=(ROWS,),
                              length=LENGTH, trees=True)
  start = model.init(jax.random.key(0), CFG)
  ref = placement.place_tree(start, step.params)
  state = step.init_state(jax.tree.map(lambda x: x * 1.01, start))   # policy != reference: the KL term is live
  metrics, first = [], None
  for b in batches():
    state, m = step(state, placement.place_tree(b, step.batch), ref)
    metrics.append(jax.device_get(m))
    first = first if first is not None else jax.device_get(state.params)
  return metrics, first, jax.device_get(state.params), state


@pytest.fixture(scope="module")
def one_device():
  return run(train_loop.single_device_mesh(), ShardingRules())


def _assert_same(got, want):
  for i, (m, w) in enumerate(zip(got[0], want[0])):
    for k in COMPARED:
      np.testing.assert_allclose(m[k], w[k], rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=f"{k} at step {i + 1}")
    assert float(m["routing_mismatch_rate"]) == float(w["routing_mismatch_rate"]), i
  for got_p, want_p in ((got[1], want[1]), (got[2], want[2])):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got_p, want_p)


def test_reference_run_trains_tree_and_flat_groups(one_device):
  metrics, first, last, _ = one_device
  assert all(np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0 for m in metrics)
  gap = [float(m["logprob_gap_no_replay"]) for m in metrics]
  # The unreplayed pass ran at step 0 (its metric due) and to fill the second batch's gap; not on the third.
  assert np.isfinite(gap[0]) and np.isfinite(gap[1]) and np.isnan(gap[2])
  assert float(metrics[0]["kl"]) != 0.0
  assert not np.array_equal(first["embed"], last["embed"])


def test_rl_step_on_data2_expert2_context2_equals_one_device(one_device):
  mesh = mesh_lib.mesh_from_config(MESH)
  got = run(mesh, MESH.rules())
  state = got[3]
  # Really sharded as the rules say: experts over `expert`, the embedding's D over `data` (FSDP), moments alike.
  assert tuple(state.params["moe_layers"]["moe"]["gate"].sharding.spec)[1] == "expert"
  assert tuple(state.params["embed"].sharding.spec) == ("tensor", "data")
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.shape == state.params["embed"].shape]
  assert len(moments) == 2 and all(tuple(x.sharding.spec) == ("tensor", "data") for x in moments)
  _assert_same(got, one_device)


@pytest.mark.slow
def test_expert_and_context_parallel_rl_step_equals_one_device(one_device):
  """The scale plan's kind of step: the EP region (capacity never binds: factor 8) and ring attention, tokens over
  data x expert."""
  cfg = dataclasses.replace(CFG, moe_impl="ep_capacity", capacity_factor=8.0, attention_impl="ring")
  rules = dataclasses.replace(MESH.rules(), batch=("data", "expert"))
  _assert_same(run(mesh_lib.mesh_from_config(MESH), rules, cfg), one_device)


def test_the_step_is_traced_under_its_own_rules():
  """The same step lowered with its rules given equals the step without them lowered inside `use_rules` of that
  table, and differs from the default table's: the run's rules reach the per-device head and the constraints."""
  mesh = mesh_lib.mesh_from_config(MESH)
  rules = dataclasses.replace(MESH.rules(), batch=("data", "expert"))
  step = placement.build_step(CFG, RLConfig(), mesh, rules, rows=(ROWS,),
                              length=LENGTH, trees=True)
  state = step.abstract_state()
  batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batches()[0], step.batch)
  ref = state.params

  def lowered(rules_arg, ambient):
    fn = rl_step_lib.make_rl_step(CFG, RLConfig(), step.optimizer, step.state, step.batch, step.params, rules_arg)
    with use_rules(ambient), jax.set_mesh(mesh):
      return fn.lower(state, batch, ref).as_text()

  own = step.lower(state, batch, ref).as_text()
  assert own == lowered(None, rules)
  assert own != lowered(None, ShardingRules())
  assert own == lowered(rules, ShardingRules())


@pytest.mark.parametrize("axes, cfg_change, rows, length, match", [
    ({"expert": 3}, {}, 6, 16, r"mesh axes expert=3 \(= 3\) shard the model's experts \(model.n_routed_experts\) "
                               r"but do not divide it \(8\): change mesh.expert"),
    ({"tensor": 4}, {}, 8, 16, r"tensor=4 \(= 4\) shard the model's attention heads .* \(2\)"),
    ({"data": 4}, {}, 6, 16, r"data=4 \(= 4\) shard a step's rows .* \(6\)"),
    ({"context": 4}, {"attention_impl": "ring"}, 8, 12, r"context=4 x 2 \(= 8\) shard a step's length "
                                                        r"\(harness.context_budget\) but do not divide it \(12\)"),
])
def test_a_mesh_that_does_not_divide_names_the_axis_and_the_sizes(axes, cfg_change, rows, length, match):
  n = int(np.prod(list(axes.values())))
  mesh = mesh_lib.make_mesh(axes, devices=jax.devices()[:n])
  with pytest.raises(ValueError, match=match):
    layout.check_mesh(dataclasses.replace(CFG, **cfg_change), mesh, ShardingRules(), (rows,), length)


def test_placing_moves_device_arrays_without_a_host_copy():
  """Weights on one device go to a mesh by device_put (no host round trip); already placed ones are left as is."""
  mesh = mesh_lib.mesh_from_config(MESH)
  shardings = model.shardings(CFG, mesh, MESH.rules())
  params = jax.device_put(model.init(jax.random.key(0), CFG), jax.devices()[0])
  with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
    placed = placement.place_tree(params, shardings)
  assert placed["embed"].sharding == shardings["embed"]
  np.testing.assert_array_equal(placed["embed"], params["embed"])
  again = placement.place_tree(placed, shardings)
  assert all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(again)))


def test_the_sglang_export_from_sharded_params_equals_the_host_export(tmp_path):
  """The fleet's Hugging Face directory is written from the params as the trainer holds them (each tensor from
  the shards of the devices holding it), and holds exactly what an export of the same params from the host does."""
  from safetensors.numpy import load_file

  from composer_jax import configs
  from composer_jax.rl import fleet
  from composer_jax.rl.config import RunConfig
  from experiments.configs import rl as rl_configs

  cfg = configs.from_dict(RunConfig, rl_configs.get_config("test"), workdir=str(tmp_path))
  mesh = mesh_lib.mesh_from_config(MESH)
  params = model.init(jax.random.key(0), cfg.model)
  sharded = placement.place_tree(params, model.shardings(cfg.model, mesh, MESH.rules()))
  assert not sharded["embed"].sharding.is_fully_replicated
  got, want = fleet.export(cfg, sharded, 2), fleet.export(cfg, jax.device_get(params), 1)
  got_t, want_t = load_file(f"{got}/model.safetensors"), load_file(f"{want}/model.safetensors")
  assert sorted(got_t) == sorted(want_t) and len(got_t) > 10
  for k in want_t:
    np.testing.assert_array_equal(got_t[k], want_t[k], err_msg=k)


@pytest.mark.parametrize("override, match", [
    ({"mesh.data": 3}, r"data=3 \(= 3\) shard a step's rows .* \(4\): change them or the mesh axes"),
    ({"mesh.expert": 3}, r"expert=3 \(= 3\) shard the model's experts \(model.n_routed_experts\) .* \(4\)"),
    ({"mesh.tensor": 4}, r"tensor=4 \(= 4\) shard the model's attention heads \(model.num_attention_heads\) .* \(2\)"),
])
def test_a_run_config_whose_mesh_does_not_fit_fails_at_once(override, match):
  """`--config.mesh.*` is checked when the config is read, before the warm start's minutes of work."""
  from composer_jax import configs
  from composer_jax.rl.config import RunConfig
  from experiments.configs import rl as rl_configs
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("test"), workdir="/tmp/unused")
  with pytest.raises(ValueError, match=match):
    configs.replace(cfg, **override)
