r"""Training steps compiled (never run) for H200 clusters, at full depth: memory per device, collectives, roofline.

  python benchmarks/scale_plan.py                                  # kimi_k2: every stage x mesh of PLANS
  python benchmarks/scale_plan.py --variant moonlight_16b          # the ~16B / ~3B-active shape on one node
  python benchmarks/scale_plan.py --stages pretrain_32k --devices 64 --out plan_64.json
  python benchmarks/scale_plan.py --combine plan_*.json [--markdown]   # merge runs: the table and the last line

For each stage (`STAGES`: 32k pretraining, the 256k long-context extension with ring attention, an RL batch, and
8k/32k rows for the 16B shape) and each mesh of the variant's `PLANS` entry, a separate process with that many
fake CPU devices (`--xla_force_host_platform_device_count`, set before jax is imported) builds the real step with
the project's public functions (`train.step.make_train_step`, `rl.step.make_rl_step`; params from
`model.shardings`, the AdamW of `train.optim`), lowers it on abstract inputs carrying their shardings and compiles
it: **the program a GPU would run** — every layer, `lax.scan` over each stack (`scan_layers=True`; unrolled
layers let XLA:CPU schedule the recomputation early, so remat saved nothing), remat as the stage names it
(`Stage.remat_policy`). Nothing is extrapolated. From the compiled executable it reads:
- per-device argument / temp / output bytes (`memory_analysis()`);
- every collective (`hlo_collectives.py`), in the program's element types (XLA:CPU widens bf16 collectives to
  f32, tuples included; a GPU does not), loops counted per iteration;
- executed matmul FLOPs (`hlo_costs.dot_flops`, loops counted per iteration) beside the model's FLOPs, so work
  a device repeats (a whole-batch op on every device, remat) shows as `hlo_flops / model_flops`;
- the buffers live at the peak (`hlo_costs.peak_buffers`, from XLA's live-range dump), attributed to the JAX ops
  that made them, with **XLA:CPU-only** bytes apart: f32 copies XLA:CPU makes of bf16 weights and activations (it
  has no bf16 arithmetic) and the widened half of upcast collectives. `temp_gpu` = temp minus those bytes is what
  "fits" is judged on; both are printed.

**Roofline** (per device, a lower bound on the step time, so an upper bound on MFU):
  t_compute = executed matmul FLOPs (from the HLO) / peak;
  t_memory  = (arguments + outputs + 2 x temp_gpu) / HBM bandwidth (every buffer written once and read once);
  t_comm    = NVLink wire bytes / NVLink bandwidth + IB wire bytes / IB bandwidth (a group that leaves its node of
              8 GPUs is charged entirely at the IB rate);
  step      = max(t_compute, t_memory, t_comm) (perfect overlap);   MFU bound = model FLOPs / (step x peak).
Model FLOPs per token: 2 x active parameters (the LM head included, the embedding lookup not) plus causal
attention 2 x H x (d_qk + d_v) x L / 2 per layer, per forward; an LM step is 3 forwards' worth (forward +
backward), an RL step 5 (the policy's forward + backward, the unreplayed and the reference forwards).

**H200 figures used** (one GPU of an 8-GPU HGX/DGX H200 node):
- HBM3e 141 GB at 4.8 TB/s; BF16 dense Tensor Core peak 989 TFLOP/s (the datasheet's 1,979 is with 2:4
  sparsity): NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ .
- NVLink 4: 900 GB/s per GPU, both directions together, i.e. 450 GB/s each way: same datasheet.
- InfiniBand between nodes: one ConnectX-7 NDR 400 Gb/s port per GPU = 50 GB/s each way: NVIDIA DGX H200
  datasheet (8x single-port ConnectX-7, 400 Gb/s), https://www.nvidia.com/en-us/data-center/dgx-h200/ .
**Fits** means arguments + temp_gpu + outputs - donated (aliased) bytes <= 141 GB x (1 - HEADROOM), HEADROOM = 10%
for the CUDA context, NCCL buffers and allocator fragmentation.

Caveats. XLA:CPU's buffer assignment and fusion are not XLA:GPU's; `--platform gpu` (run by
`benchmarks/gpu_check.sh` when a GPU is lent) compiles the same steps with the GPU compiler on a mocked topology
(`child_env`); it has not run yet (no GPU was lent while it was written). Collectives are XLA:CPU's choice after
SPMD partitioning (a GPU compile runs its own combiners and turns all-reduce + slice into reduce-scatter). AdamW
moments are kept in the params' dtype (bf16: `optax.adamw` default), so params + optimizer state is 6 bytes per
parameter.

The last line is JSON: per stage the smallest mesh that fits and its MFU bound, and every row.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import hlo_collectives, hlo_costs, hlo_module  # noqa: E402

H200 = {"hbm_bytes": 141e9, "bf16_flops": 989e12, "hbm_bw": 4.8e12, "nvlink_bw": 450e9, "ib_bw": 50e9,
        "devices_per_node": 8}
HEADROOM = 0.10


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
# the ring again). Keeping the EP return exchange's result too (`save_attention_ep_return`, one exchange of six
# fewer per layer) needs 35 GB more per device at 32k on 256 devices, past the budget (parallel/README.md).
STAGES = {
    "pretrain_8k": Stage("lm", 8192),
    "pretrain_32k": Stage("lm", 32768),
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


def rules_for(axes: dict[str, int], n_experts: int = 384):
  """Tokens over data x expert (seq over context); every dense weight's D over data x context (ZeRO-3), expert
  weights' D too when a device holds more than 8 experts (with fewer, gathering them costs more than it saves)."""
  from composer_jax.parallel.rules import ShardingRules
  fsdp = tuple(a for a in ("data", "context") if axes.get(a, 1) > 1) or None
  few_experts = n_experts // axes.get("expert", 1) <= 8
  return ShardingRules(batch=("data", "expert"), embed=fsdp, expert_embed=None if few_experts else fsdp)


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


# ----- compiled figures (run inside a process with the right device count) -----

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
  """`rl.batch.make_batch`'s fields, rows over the batch axes and positions over `context`."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from composer_jax.parallel import layout
  row_spec = layout.batch_spec(mesh, rules)
  b_axes, l_axes = row_spec
  n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
  fields = {k: ((rows, seq), jnp.int32) for k in ("tokens", "segment_ids", "positions", "seq")}
  fields.update({k: ((rows, seq), jnp.float32) for k in ("gen_mask", "inf_logprobs")})
  fields.update({k: ((rows,), jnp.float32) for k in ("reward", "passed", "first", "valid", "is_cap",
                                                      "traj_gen_tokens")})
  fields.update({k: ((rows,), jnp.int32) for k in ("group", "staleness")})
  fields["routing"] = ((n_moe, rows, seq, cfg.num_experts_per_tok), jnp.int32)
  shard = {k: NamedSharding(mesh, P(b_axes, l_axes) if len(s) == 2 else P()) for k, (s, _) in fields.items()}
  shard["routing"] = NamedSharding(mesh, P(None, b_axes, l_axes, None))
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
  rules = rules_for(axes, cfg.n_routed_experts)
  specs = jax.tree_util.tree_flatten_with_path(model.param_specs(cfg),
                                               is_leaf=lambda x: isinstance(x, model.ArrayInfo))[0]
  layout.check_params_divisible(((jax.tree_util.keystr(k), v) for k, v in specs), mesh, rules)
  p_shard = model.shardings(cfg, mesh, rules)
  abstract_params = model.abstract_params(cfg)
  optimizer = optim.make_optimizer(OptimConfig(), abstract_params)
  abstract_state = jax.eval_shape(lambda: step_lib.init_state(abstract_params, optimizer))
  s_shard = step_lib.state_shardings(optimizer, abstract_params, p_shard)
  rows = stage.rows_per_shard * axes.get("data", 1) * axes.get("expert", 1)
  case = {"cfg": cfg, "mesh": mesh, "rules": rules, "optimizer": optimizer, "p_shard": p_shard, "s_shard": s_shard,
          "rows": rows, "stage": stage, "state": _sds(abstract_state, s_shard)}
  if stage.step == "lm":
    case["batch"], b_shard = _lm_batch(mesh, rules, rows, stage.seq)
    case["fn"] = step_lib.make_train_step(cfg, TrainConfig(), optimizer, s_shard, b_shard, rules)
    case["args"], case["module"] = (case["state"], case["batch"]), "jit_train_step"
  else:
    # The run's own builder (`rl.placement.build_step`, as `rl.trainer.Trainer` calls it): one RL step program.
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


def _child(args) -> None:
  """One process per device count: compiles its cases and prints one JSON line per case."""
  import jax
  n = jax.device_count()
  for name in args.stages:
    axes = args.mesh or PLANS[args.variant][name][n]
    stage = dataclasses.replace(STAGES[name], seq=args.seq or STAGES[name].seq,
                                remat_policy=args.remat_policy or STAGES[name].remat_policy)
    fig = compile_case(args.variant, stage, axes, args.moe_layers or None, args.dump_dir)
    print("CASE " + json.dumps({"stage": name, "devices": n, "axes": axes, "seq": stage.seq,
                                "remat_policy": stage.remat_policy, **fig}), flush=True)


# ----- roofline, table (parent process) -----

def roofline(row: dict) -> dict:
  """Step-time lower bound and MFU upper bound for one row (per device figures)."""
  c = row["collectives"]
  t = {"compute": row["hlo_flops"] / H200["bf16_flops"],
       "memory": (row["argument"] + row["output"] + 2 * row["temp_gpu"]) / H200["hbm_bw"],
       "comm": sum(v["nvlink_bytes"] / H200["nvlink_bw"] + v["ib_bytes"] / H200["ib_bw"] for v in c.values())}
  step = max(t.values())
  return {"t": t, "step_s": step, "limit": max(t, key=t.get),
          "mfu_bound": row["model_flops"] / (step * H200["bf16_flops"]), "tokens_per_s": row["tokens"] / step}


def summarize_case(case: dict) -> dict:
  """One compiled case with its GPU-side temp estimate, fit verdict and roofline."""
  cpu_only = case.get("peak", {}).get("cpu_only_bytes", 0)
  row = dict(case, temp_gpu=case["temp"] - cpu_only)
  row["total"] = row["argument"] + row["temp"] + row["output"] - row["alias"]
  row["total_gpu"] = row["total"] - cpu_only
  budget = H200["hbm_bytes"] * (1 - HEADROOM)
  return {**row, "fits": row["total_gpu"] <= budget, "budget": budget,
          "flops_ratio": row["hlo_flops"] / row["model_flops"], **roofline(row)}


def _mesh_str(axes: dict[str, int]) -> str:
  return "x".join(f"{k}={v}" for k, v in axes.items() if v > 1)


def print_table(rows: list[dict]) -> None:
  gb = 1e9
  print(f"Per device, full depth; fits: total_gpu <= {H200['hbm_bytes'] / gb:.0f} GB x (1 - {HEADROOM:.0%}). "
        "Collectives: wire GB per step (NVLink / IB).")
  head = (f"{'stage':13} {'devices':>7} {'mesh':26} {'params+opt':>10} {'temp':>8} {'cpu-only':>8} {'total_gpu':>9} "
          f"{'fits':>5} {'all-gather':>13} {'reduce-scat':>13} {'all-reduce':>13} {'all-to-all':>13} {'permute':>13} "
          f"{'hlo/model':>9} {'t_comp':>7} {'t_mem':>6} {'t_comm':>7} {'limit':>8} {'MFU<=':>6}")
  print(head)
  for r in rows:
    c = r["collectives"]
    cs = " ".join(f"{c[k]['nvlink_bytes'] / gb:6.0f}/{c[k]['ib_bytes'] / gb:<6.0f}" for k in
                  ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"))
    print(f"{r['stage']:13} {r['devices']:>7} {_mesh_str(r['axes']):26} {r['params_opt'] / gb:10.1f} "
          f"{r['temp'] / gb:8.1f} {(r['temp'] - r['temp_gpu']) / gb:8.1f} {r['total_gpu'] / gb:9.1f} "
          f"{'yes' if r['fits'] else 'NO':>5} {cs} {r['flops_ratio']:9.2f} "
          f"{r['t']['compute']:7.2f} {r['t']['memory']:6.2f} {r['t']['comm']:7.2f} {r['limit']:>8} "
          f"{r['mfu_bound']:6.1%}")


def markdown_table(rows: list[dict]) -> str:
  """The plan as a markdown table (what composer_jax/parallel/README.md shows, generated from --out files)."""
  gb = 1e9
  lines = ["| stage | devices | mesh | params + opt GB | temp GB (CPU-only) | total GB on GPU | fits | all-to-all GB | "
           "all-gather GB | all-reduce GB | reduce-scatter GB | permute GB | HLO / model FLOPs | "
           "t compute / memory / comm s | limit | MFU bound |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

  def wire(c):
    return f"{(c['nvlink_bytes'] + c['ib_bytes']) / gb:.0f} ({c['ib_bytes'] / gb:.0f} IB)"
  for r in rows:
    c, t = r["collectives"], r["t"]
    lines.append(f"| {r['stage']} | {r['devices']} | {_mesh_str(r['axes'])} | {r['params_opt'] / gb:.1f} | "
                 f"{r['temp'] / gb:.1f} ({(r['temp'] - r['temp_gpu']) / gb:.1f}) | {r['total_gpu'] / gb:.1f} | "
                 f"{'yes' if r['fits'] else 'no'} | {wire(c['all-to-all'])} | {wire(c['all-gather'])} | "
                 f"{wire(c['all-reduce'])} | {wire(c['reduce-scatter'])} | {wire(c['collective-permute'])} | "
                 f"{r['flops_ratio']:.2f} | {t['compute']:.2f} / {t['memory']:.2f} / {t['comm']:.2f} | "
                 f"{r['limit']} | {r['mfu_bound']:.1%} |")
  return "\n".join(lines)


def child_env(n: int, platform: str, dump: str) -> dict[str, str]:
  """The environment of the process that compiles on `n` devices: `n` fake CPU devices, or (platform "gpu", on a
  machine with one real GPU) a mocked topology of n / 8 hosts x 8 GPUs (`jax_mock_gpu_topology`, as MaxText's
  `train_compile.py` does), so the GPU compiler builds the n-device program without n GPUs."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if platform == "cpu":
    # LLVM's optimisation level changes code, not buffers or collectives: -O0 compiles faster.
    env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={n} " + hlo_costs.dump_flags(dump)
                        + " --xla_backend_optimization_level=0")
    return env
  if platform != "gpu":
    raise ValueError(f"platform={platform!r}; valid: cpu, gpu")
  per_host = H200["devices_per_node"]
  if n % per_host:
    raise ValueError(f"a mocked GPU topology has hosts of {per_host} GPUs; {n} devices is not a multiple")
  # Autotuning would time kernels on the one real GPU for every mocked shard: off, as train_compile.py has it.
  env.update(JAX_PLATFORMS="cuda", JAX_MOCK_GPU_TOPOLOGY=f"1x{n // per_host}x{per_host}",
             XLA_FLAGS=hlo_costs.dump_flags(dump) + " --xla_gpu_shard_autotuning=false")
  return env


def run_children(args) -> list[dict]:
  """One subprocess per device count (the fake device count is fixed when jax starts)."""
  cases = []
  for n in args.devices:
    stages = [s for s in args.stages if args.mesh or n in PLANS[args.variant].get(s, {})]
    if not stages:
      continue
    with tempfile.TemporaryDirectory() as dump:
      env = child_env(n, args.platform, dump)
      cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", args.variant, "--dump_dir", dump,
             "--stages", *stages, "--seq", str(args.seq or 0), "--moe_layers", str(args.moe_layers or 0)]
      if args.remat_policy:
        cmd += ["--remat_policy", args.remat_policy]
      if args.mesh:
        cmd += ["--mesh", ",".join(f"{k}={v}" for k, v in args.mesh.items())]
      with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:     # streamed: cases already compiled survive a later failure
          if line.startswith("CASE "):
            cases.append(json.loads(line[5:]))
            print(f"compiled {cases[-1]['stage']} on {n} devices", file=sys.stderr, flush=True)
        if proc.wait():
          err.seek(0)
          print(f"compiling on {n} devices failed; kept {len(cases)} cases:\n{err.read()[-4000:]}", file=sys.stderr)
  return cases


def _parse_mesh(text: str) -> dict[str, int]:
  axes = dict(kv.split("=") for kv in text.split(","))
  return {k: int(v) for k, v in axes.items()}


def report(rows: list[dict], variant: str, load: tuple, out: str | None = None) -> dict:
  """Prints the table and the last-line JSON (per stage: the smallest mesh that fits and its MFU bound)."""
  print_table(rows)
  best = {}
  for s in dict.fromkeys(r["stage"] for r in rows):
    fit = sorted((r for r in rows if r["stage"] == s and r["fits"]), key=lambda r: r["devices"])
    best[s] = ({"devices": fit[0]["devices"], "mesh": _mesh_str(fit[0]["axes"]),
                "mfu_bound": round(fit[0]["mfu_bound"], 4), "limit": fit[0]["limit"],
                "total_gpu_gb": round(fit[0]["total_gpu"] / 1e9, 1)} if fit else None)
  summary = {"variant": variant, "smallest_fitting": best,
             "load_avg": [round(x, 2) for x in load],
             "rows": [{"stage": r["stage"], "devices": r["devices"], "mesh": _mesh_str(r["axes"]),
                       "total_gpu_gb": round(r["total_gpu"] / 1e9, 1), "fits": r["fits"],
                       "flops_ratio": round(r["flops_ratio"], 3),
                       "mfu_bound": round(r["mfu_bound"], 4), "limit": r["limit"]} for r in rows]}
  if out:
    with open(out, "w") as f:
      json.dump({"variant": variant, "h200": H200, "headroom": HEADROOM, "load_avg": list(load), "rows": rows,
                 "summary": summary}, f, indent=1)
  print(json.dumps(summary))
  return summary


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="kimi_k2", choices=list(PLANS))
  ap.add_argument("--stages", nargs="+", choices=list(STAGES), help="default: every stage the variant plans")
  ap.add_argument("--devices", type=lambda s: [int(x) for x in s.split(",")],
                  help="device counts (default: every count the variant plans)")
  ap.add_argument("--out", help="write the rows as JSON here")
  ap.add_argument("--combine", nargs="+", help="only print the table and JSON of earlier --out files, merged")
  ap.add_argument("--markdown", action="store_true", help="with --combine: print the README's markdown table")
  ap.add_argument("--mesh", type=_parse_mesh, help="one mesh for every stage, e.g. data=2,expert=4 (experiments)")
  ap.add_argument("--seq", type=int, default=0, help="override the stages' row length (experiments)")
  ap.add_argument("--remat_policy", help="one remat policy for every stage (experiments; model.remat.REMAT_POLICIES)")
  ap.add_argument("--moe_layers", type=int, default=0, help="fewer MoE layers than published (experiments)")
  ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"],
                  help="gpu: compile with the GPU compiler on a mocked topology (one real GPU; gpu_check.sh)")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--dump_dir", help=argparse.SUPPRESS)
  args = ap.parse_args()
  plan = PLANS[args.variant]
  args.stages = args.stages or list(plan)
  if args.child:
    return _child(args)
  if args.combine:
    runs = []
    for path in args.combine:
      with open(path) as f:
        runs.append(json.load(f))
    rows = sorted((r for run in runs for r in run["rows"]), key=lambda r: (list(STAGES).index(r["stage"]),
                                                                            r["devices"]))
    if args.markdown:
      return print(markdown_table(rows))
    return report(rows, runs[0]["variant"], max(tuple(run.get("load_avg", ())) for run in runs), args.out)
  args.devices = args.devices or sorted({n for s in args.stages for n in plan.get(s, {})})
  load = os.getloadavg()
  cases = run_children(args)
  report([summarize_case(c) for c in cases], args.variant, load, args.out)


if __name__ == "__main__":
  main()
