"""The steps the scale plan compiles: stages, meshes per variant and device count, sharding rules, the model
config, the abstract sharded arguments, and the figures read from each compiled executable (`measure`).

Runs inside a process whose (fake or mocked) device count is the mesh's (`scale_plan.py` starts one per count).
"""
from __future__ import annotations

import dataclasses

from benchmarks import hlo_collectives, hlo_costs, hlo_module
from benchmarks.scale_plan_roofline import H200


def RL_CONFIG():  # noqa: N802  (a constant, built lazily so that importing this file does not import jax)
  """The RL step the plan compiles: the run's (`experiments/configs/rl.py`'s default `rl` section: its loss and
  its optimizer), router replay on. Its unreplayed forward sits in a `lax.cond` (run when routing is missing or its
  metric is due): the collectives and FLOPs count that branch, the heavier one (`hlo_module`), and `RL_FORWARDS`
  counts that forward, as if it ran every step."""
  from composer_jax import configs
  from composer_jax.rl.config import RLConfig
  from experiments.configs import rl
  return configs.from_dict(RLConfig, rl.get_config().rl)


# Forward passes' worth of model FLOPs per step: LM = forward + backward; RL = the policy's forward + backward,
# the reference forward and (with replay, on steps that need it) the unreplayed forward, counted here.
LM_FORWARDS, RL_FORWARDS = 3, 5


@dataclasses.dataclass(frozen=True)
class Stage:
  step: str          # "lm" (train.step) | "rl" (rl.step)
  seq: int           # tokens per row
  rows_per_shard: int = 1   # rows per (data x expert) batch shard
  remat_policy: str = "save_attention"   # model.remat.REMAT_POLICIES


# Remat: every stage keeps the ring's output (`save_attention`: a few GB per device, and the backward does not run
# the ring again); 32k pretraining keeps the EP return exchange's result too (`save_attention_ep_return`: one
# exchange of six fewer per layer, for each token's chosen experts' output rows, ~28 GB per device on 256 devices).
STAGES = {
    "pretrain_8k": Stage("lm", 8192),
    "pretrain_32k": Stage("lm", 32768, remat_policy="save_attention_ep_return"),
    "long_256k": Stage("lm", 262144),
    "rl": Stage("rl", 32768),
}

# Per variant, stage and device count: mesh axis sizes (data, expert, context, tensor; tensor is innermost in the
# device order, then context, so a context group of 4 is half a node and its weight gathers ride NVLink). Weights
# are FSDP-sharded over data x context (`rules_for`), experts over `expert`. kimi_k2: the targets are
# pretrain_32k and rl on <= 256 devices, long_256k on <= 1024; context 32 at 256k keeps each device's L/CP at
# 8192 (the ring's blocks are tiled, `ModelConfig.ring_block`, so no [L/CP, L/CP] scores are held). At 256 devices
# expert=32 x context=8 (FSDP inside the node, L/CP = 4096) fits where data=4 x expert=16 x context=4 (FSDP
# gathers over IB, L/CP = 8192) does not (README table: both); likewise expert=32 x context=32 for 256k rows on
# 1024 (12 experts per device instead of 192 to gather). moonlight_16b: one node.
PLANS = {
    "kimi_k2": {
        "pretrain_32k": {64: {"expert": 16, "context": 4}, 256: {"expert": 32, "context": 8}},
        "long_256k": {256: {"data": 4, "expert": 2, "context": 32}, 1024: {"expert": 32, "context": 32}},
        "rl": {64: {"expert": 16, "context": 4}, 256: {"expert": 32, "context": 8}},
    },
    "moonlight_16b": {
        "pretrain_8k": {8: {"expert": 8}},
        "pretrain_32k": {8: {"expert": 2, "context": 4}},
    },
}


def rules_for(axes: dict[str, int], n_experts: int = 384, zero1: bool = True):
  """Tokens over data x expert (seq over context); every dense weight's D over data x context (ZeRO-3), and q_b's
  input dim (`q_lora_in`; q_b has no D, and replicated it was the largest dense weight per device), expert weights'
  D too when a device holds more than 8 experts (with fewer, gathering them costs more than it saves).
  With `zero1`, the dense weights' AdamW moments are split over `expert` as well (`optimizer_state`): the weights
  are replicated there and their gradients summed over it anyway, so the step only adds one all-gather of the
  updated weights over `expert`, and each device holds 1/|expert| of those moments. (LM steps only: they pin the
  gradients to the params' layout, `train.step.train_step`; the RL step does not yet, and without that the
  partitioner sums every layer's gradients over all devices inside the backward loop.)"""
  from composer_jax.parallel.rules import ShardingRules
  fsdp = tuple(a for a in ("data", "context") if axes.get(a, 1) > 1) or None
  few_experts = n_experts // axes.get("expert", 1) <= 8
  return ShardingRules(batch=("data", "expert"), embed=fsdp, q_lora_in=fsdp, expert_embed=None if few_experts else fsdp,
                       optimizer_state="expert" if zero1 and axes.get("expert", 1) > 1 else None)


# Expert parallelism by the compiling platform: XLA:CPU has no ragged-all-to-all, so the CPU-compiled rows use
# capacity buffers (1.25x the mean load, dispatched in FP8); a GPU compile (`--platform gpu`) runs dropless
# `ep_ragged` with a receive buffer of the same 1.25x (`ragged_buffer_factor`; rows past it are cut and counted).
EP_BY_PLATFORM = {"cpu": {"moe_impl": "ep_capacity", "ep_dispatch": "fp8"},
                  "gpu": {"moe_impl": "ep_ragged", "ragged_buffer_factor": 1.25}}


def plan_model_config(variant: str, seq: int, n_moe_layers: int | None = None):
  """The variant's shape, scanned, with ring attention and the platform's expert parallelism (`EP_BY_PLATFORM`;
  FP8 dispatch is DeepSeek-V3's recipe, the architecture both variants share: e4m3 tokens out, the return in bf16);
  `n_moe_layers` (tests) shortens the MoE stack, None keeps the published depth."""
  import jax

  from composer_jax import configs, model
  from experiments.configs import model as model_configs
  cfg = configs.from_dict(model.ModelConfig, model_configs.get_config(variant).to_dict())
  n_layers = cfg.num_hidden_layers if n_moe_layers is None else cfg.first_k_dense_replace + n_moe_layers
  return dataclasses.replace(cfg, num_hidden_layers=n_layers, scan_layers=True, attention_impl="ring",
                             max_position_embeddings=max(seq, cfg.max_position_embeddings),
                             **EP_BY_PLATFORM["gpu" if jax.default_backend() == "gpu" else "cpu"])


def _sds(abstract, shardings):
  import jax
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _per_device_bytes(tree) -> int:
  import math

  import jax
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _lm_batch(mesh, rules, rows, seq):
  import jax
  import jax.numpy as jnp

  from composer_jax.parallel import layout
  sharding = layout.batch_sharding(mesh, rules)
  layout.check_batch_shape(rows, seq, sharding)
  ints = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=sharding)
  return {"tokens": ints, "segment_ids": ints, "positions": ints, "loss_mask": ints}, sharding


def _rl_batch(mesh, rules, rows, seq, cfg):
  """`rl.batch.make_batch`'s fields (one sequence a row), placed by `rl.placement.batch_shardings`."""
  import jax

  from composer_jax.rl import batch as rl_batch
  from composer_jax.rl import placement
  n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
  fields = rl_batch.field_shapes(rows, seq, rows, n_moe, cfg.num_experts_per_tok)
  shard = placement.batch_shardings(mesh, rules)
  batch = {k: jax.ShapeDtypeStruct(s, d, sharding=shard[k]) for k, (s, d) in fields.items()}
  return batch, shard


def build_case(variant: str, stage: Stage, axes: dict[str, int], n_moe_layers: int | None = None,
               devices=None) -> dict:
  """The jitted step of `stage` on mesh `axes` and its abstract, sharded arguments (nothing allocated)."""
  import jax

  from composer_jax import model
  from composer_jax.parallel import layout, make_mesh
  from composer_jax.rl import placement
  from composer_jax.train import optim
  from composer_jax.train import step as step_lib
  from composer_jax.train.config import OptimConfig, TrainConfig

  cfg = dataclasses.replace(plan_model_config(variant, stage.seq, n_moe_layers), remat_policy=stage.remat_policy)
  mesh = make_mesh(axes, devices=devices)
  rules = rules_for(axes, cfg.n_routed_experts, zero1=stage.step == "lm")
  specs = jax.tree_util.tree_flatten_with_path(model.param_specs(cfg),
                                               is_leaf=lambda x: isinstance(x, model.ArrayInfo))[0]
  layout.check_params_divisible(((jax.tree_util.keystr(k), v) for k, v in specs), mesh, rules)
  p_shard = model.shardings(cfg, mesh, rules)
  abstract_params = model.abstract_params(cfg)
  optimizer = optim.make_optimizer(OptimConfig(), abstract_params)
  abstract_state = jax.eval_shape(lambda: step_lib.init_state(abstract_params, optimizer))
  s_shard = step_lib.state_shardings(optimizer, abstract_params, p_shard, rules.mesh_axes("optimizer_state"))
  rows = stage.rows_per_shard * axes.get("data", 1) * axes.get("expert", 1)
  case = {"cfg": cfg, "mesh": mesh, "rules": rules, "optimizer": optimizer, "p_shard": p_shard, "s_shard": s_shard,
          "rows": rows, "stage": stage, "state": _sds(abstract_state, s_shard)}
  if stage.step == "lm":
    case["batch"], b_shard = _lm_batch(mesh, rules, rows, stage.seq)
    case["fn"] = step_lib.make_train_step(cfg, TrainConfig(), optimizer, s_shard, b_shard, rules)
    case["args"], case["module"] = (case["state"], case["batch"]), "jit_train_step"
  else:
    # The run's own builder (`rl.placement.build_step`: the placement and jit of `start_rl_step`): one RL step program.
    step = placement.build_step(cfg, RL_CONFIG(), mesh, rules, rows=(rows,), length=stage.seq)
    case["batch"], b_shard = _rl_batch(mesh, rules, rows, stage.seq, cfg)
    case["state"], case["optimizer"] = step.abstract_state(), step.optimizer
    case["fn"] = step
    case["args"], case["module"] = (case["state"], case["batch"], _sds(abstract_params, p_shard)), "jit_rl_step"
  case["b_shard"] = b_shard
  return case


def model_flops_per_token(cfg, seq: int) -> float:
  """Forward matmul FLOPs per token: 2 x active params + causal attention over `seq`."""
  from composer_jax import model
  _, active = model.count_params(cfg)
  attn = cfg.num_hidden_layers * 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq / 2
  return 2 * active + attn


def measure(compiled, case: dict, dump_dir: str | None) -> dict:
  """Per-device memory, collectives, executed and model FLOPs, and (with an XLA dump) the peak's buffers."""
  mem = compiled.memory_analysis()
  module = hlo_module.parse_module(compiled.as_text())
  parsed = hlo_collectives.parse(module, case["mesh"].size, H200["devices_per_node"])
  colls = hlo_collectives.summarize(parsed)
  # Of those, the ones our shard_map regions issue (EP exchanges, the ring, the head); the rest the partitioner's.
  region = hlo_collectives.summarize(parsed, op_name_contains="shard_map")
  state, batch = case["args"][0], case["args"][1]
  stage, tokens = case["stage"], case["rows"] * batch["tokens"].shape[1]
  forwards = LM_FORWARDS if stage.step == "lm" else RL_FORWARDS
  model_flops = forwards * model_flops_per_token(case["cfg"], stage.seq) * tokens / case["mesh"].size
  flops = hlo_costs.dot_flops(module)
  out = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
         "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes,
         "params_opt": _per_device_bytes(state.params) + _per_device_bytes(state.opt_state),
         "ref_params": _per_device_bytes(case["args"][2]) if len(case["args"]) > 2 else 0,
         "batch": _per_device_bytes(batch), "collectives": colls, "region_collectives": region,
         "hlo_flops": flops["total"], "hlo_flops_by_scope": flops["by_scope"], "model_flops": model_flops,
         "tokens": tokens, "rows": case["rows"]}
  if dump_dir:
    out["peak"] = hlo_costs.peak_buffers(module, hlo_costs.live_range_text(dump_dir, case["module"]))
  return out


def compile_case(variant: str, stage: Stage, axes: dict[str, int], n_moe_layers: int | None, dump_dir: str | None,
                 devices=None) -> dict:
  """Compiles one stage's step on one mesh; returns `measure`'s per-device figures."""
  import jax

  from composer_jax.parallel.rules import use_rules
  case = build_case(variant, stage, axes, n_moe_layers, devices)
  with jax.set_mesh(case["mesh"]), use_rules(case["rules"]):    # the RL step reads the rules at trace time
    compiled = case["fn"].lower(*case["args"]).compile()
  return measure(compiled, case, dump_dir)


def compile_for_run(variant: str, stage: Stage, axes: dict[str, int], n_moe_layers: int | None, seed: int = 0):
  """An LM case with real arrays: (compiled step, state, batch, its `measure` figures) to run and compare."""
  import jax
  import numpy as np

  from composer_jax import model
  from composer_jax.parallel.rules import use_rules
  from composer_jax.train import step as step_lib
  if stage.step != "lm":
    raise ValueError(f"compile_for_run builds LM steps only, got stage step {stage.step!r}")
  case = build_case(variant, stage, axes, n_moe_layers)
  cfg, seq = case["cfg"], stage.seq
  with jax.set_mesh(case["mesh"]), use_rules(case["rules"]):
    params = model.init(jax.random.key(seed), cfg, case["mesh"], case["rules"])
    state = jax.jit(lambda p: step_lib.init_state(p, case["optimizer"]), out_shardings=case["s_shard"])(params)
    del params
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (case["rows"], seq)).astype(np.int32)
    batch = jax.device_put({"tokens": tokens, "segment_ids": np.ones_like(tokens), "loss_mask": np.ones_like(tokens),
                            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), tokens.shape).copy()},
                           case["b_shard"])
    compiled = case["fn"].lower(state, batch).compile()
  return compiled, state, batch, measure(compiled, case, None)
