r"""The Kimi K2 training steps compiled (never run) for H200 clusters: memory per device, collectives, roofline.

  python benchmarks/scale_plan.py                       # every stage x mesh below (~30 min on 2 busy cores)
  python benchmarks/scale_plan.py --stages pretrain_32k --devices 64 --depths 1,2,3,4   # the depth check
  python benchmarks/scale_plan.py --out plan.json       # also write the rows (composer_jax/parallel/plan_table.py)

For each stage (`STAGES`: the report's 32k pretraining, the 256k long-context extension with ring attention, and an
RL batch) and each mesh (`MESHES`: 64, 256 and 1024 devices standing for 8, 32 and 128 H200 nodes), a separate
process with that many fake CPU devices (`--xla_force_host_platform_device_count`, set before jax is imported)
builds the real step with the project's public functions (`train.step.make_train_step`, `rl.step.make_rl_step`;
params from `model.shardings`, the AdamW of `train.optim`), lowers it on abstract inputs carrying their shardings
and compiles it. From the compiled executable it reads per-device argument / temp / output bytes
(`memory_analysis()`), and from its HLO every collective (`hlo_collectives.py`: kind, bytes in the program's own
element types, group, whether the group leaves a node).

**Depth.** Compiling 61 layers of this shape is too slow here, so each case is compiled with 1 dense + 1 and
1 + 2 MoE layers, with layers unrolled (`scan_layers=False`: a `while` body's collectives and buffers are counted
once however many layers it runs, so only unrolled layers make each one visible), remat as the `kimi_k2` config
has it, and every per-device figure is extrapolated linearly to Kimi K2's 60 MoE layers:
v(60) = v(2) + 58 (v(2) - v(1)). That per-device bytes are linear in depth is measured, not assumed: `--depths
1,2,3,4` compiles 1..4 MoE layers and prints the largest deviation of each figure from the straight line through
the first two (the `depth_check` of the last line).

**Roofline** (per device, a lower bound on the step time, so an upper bound on MFU):
  t_compute = executed FLOPs / peak; executed = model FLOPs + the forward recomputed by remat;
  t_memory  = (arguments + outputs + 2 x temp) / HBM bandwidth (every buffer written once and read once);
  t_comm    = NVLink wire bytes / NVLink bandwidth + IB wire bytes / IB bandwidth (a group that leaves its node of
              8 GPUs is charged entirely at the IB rate);
  step      = max(t_compute, t_memory, t_comm) (perfect overlap);   MFU bound = model FLOPs / (step x peak).
Model FLOPs per token: 2 x active parameters (Kimi K2: 31.7B, the LM head included, the embedding lookup not) plus
causal attention 2 x H x (d_qk + d_v) x L / 2 per layer, per forward; an LM step is 3 forwards' worth (forward +
backward), an RL step 5 (the policy's forward + backward, the unreplayed and the reference forwards).

**H200 figures used** (one GPU of an 8-GPU HGX/DGX H200 node):
- HBM3e 141 GB at 4.8 TB/s; BF16 dense Tensor Core peak 989 TFLOP/s (the datasheet's 1,979 is with 2:4
  sparsity): NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ .
- NVLink 4: 900 GB/s per GPU, both directions together, i.e. 450 GB/s each way: same datasheet.
- InfiniBand between nodes: one ConnectX-7 NDR 400 Gb/s port per GPU = 50 GB/s each way: NVIDIA DGX H200
  datasheet (8x single-port ConnectX-7, 400 Gb/s), https://www.nvidia.com/en-us/data-center/dgx-h200/ .
**Fits** means arguments + temp + outputs - donated (aliased) bytes <= 141 GB x (1 - HEADROOM), HEADROOM = 10% for
the CUDA context, NCCL buffers and allocator fragmentation.

Caveats. XLA:CPU's buffer assignment and fusion are not XLA:GPU's; temp bytes are what this compiler needs for
the program, a GPU compile differs by its fusions. Collectives are XLA:CPU's choice after SPMD partitioning (a
GPU compile runs its own combiners and turns all-reduce + slice into reduce-scatter). AdamW moments are kept in
the params' dtype (bf16: `optax.adamw` default), so params + optimizer state is 6 bytes per parameter.

The last line is JSON: per stage the smallest mesh that fits and its MFU bound, every row, and the depth check.
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

from benchmarks import hlo_collectives  # noqa: E402

H200 = {"hbm_bytes": 141e9, "bf16_flops": 989e12, "hbm_bw": 4.8e12, "nvlink_bw": 450e9, "ib_bw": 50e9,
        "devices_per_node": 8}
HEADROOM = 0.10


def RL_CONFIG():  # noqa: N802  (a constant, built lazily so that importing this file does not import jax)
  """The RL step the plan compiles: the default `RLConfig`, router replay on. Its unreplayed forward sits in a
  `lax.cond` (run when routing is missing or its metric is due), so the compiled program holds both branches;
  `RL_FORWARDS` counts that forward as if it ran every step."""
  from composer_jax.rl import step as rl_step_lib
  return rl_step_lib.RLConfig()


# Forward passes' worth of model FLOPs per step: LM = forward + backward; RL = the policy's forward + backward,
# the reference forward and (with replay, on steps that need it) the unreplayed forward, counted here.
LM_FORWARDS, RL_FORWARDS = 3, 5


@dataclasses.dataclass(frozen=True)
class Stage:
  step: str          # "lm" (train.step) | "rl" (rl.step)
  seq: int           # tokens per row
  rows_per_shard: int = 1   # rows per (data x expert) batch shard


STAGES = {
    "pretrain_32k": Stage("lm", 32768),
    "long_256k": Stage("lm", 262144),
    "rl": Stage("rl", 32768),
}

# Per stage and device count: mesh axis sizes (data, expert, context, tensor; tensor is innermost in the device
# order, then context, so a context group of 4 is half a node and its weight gathers ride NVLink). Weights are
# FSDP-sharded over data x context (`rules_for`), experts over `expert`: a device must hold few of the 384 experts,
# since the per-layer gather of its experts' weights grows with their number. The ring's per-step score block is
# [H, L/CP, L/CP] in f32, hence context 32 for 256k rows.
MESHES = {
    "pretrain_32k": {64: {"expert": 16, "context": 4}, 256: {"data": 4, "expert": 16, "context": 4},
                     1024: {"data": 16, "expert": 16, "context": 4}},
    "long_256k": {64: {"expert": 2, "context": 32}, 256: {"data": 4, "expert": 2, "context": 32},
                  1024: {"data": 16, "expert": 2, "context": 32}},
    "rl": {64: {"expert": 16, "context": 4}, 256: {"data": 4, "expert": 16, "context": 4},
           1024: {"data": 16, "expert": 16, "context": 4}},
}


def rules_for(axes: dict[str, int], n_experts: int = 384):
  """Tokens over data x expert (seq over context); every dense weight's D over data x context (ZeRO-3), expert
  weights' D too when a device holds more than 8 experts (with fewer, gathering them costs more than it saves)."""
  from composer_jax.parallel.rules import ShardingRules
  fsdp = tuple(a for a in ("data", "context") if axes.get(a, 1) > 1) or None
  few_experts = n_experts // axes.get("expert", 1) <= 8
  return ShardingRules(batch=("data", "expert"), embed=fsdp, expert_embed=None if few_experts else fsdp)


def plan_model_config(variant: str, n_moe_layers: int, seq: int):
  """The variant's shape with 1 + `n_moe_layers` unrolled layers, ring attention and capacity expert parallelism."""
  from composer_jax import configs, model
  from experiments.configs import model as model_configs
  cfg = configs.from_dict(model.ModelConfig, model_configs.get_config(variant).to_dict())
  return dataclasses.replace(cfg, num_hidden_layers=cfg.first_k_dense_replace + n_moe_layers, scan_layers=False,
                             attention_impl="ring", moe_impl="ep_capacity",
                             max_position_embeddings=max(seq, cfg.max_position_embeddings))


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


def build_case(variant: str, stage: Stage, axes: dict[str, int], n_moe_layers: int, devices=None) -> dict:
  """The jitted step of `stage` on mesh `axes` and its abstract, sharded arguments (nothing allocated)."""
  import jax

  from composer_jax import model
  from composer_jax.parallel import layout, make_mesh
  from composer_jax.rl import step as rl_step_lib
  from composer_jax.train import optim
  from composer_jax.train import step as step_lib
  from composer_jax.train.config import OptimConfig, TrainConfig

  cfg = plan_model_config(variant, n_moe_layers, stage.seq)
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
          "rows": rows, "state": _sds(abstract_state, s_shard)}
  if stage.step == "lm":
    case["batch"], b_shard = _lm_batch(mesh, rules, rows, stage.seq)
    case["fn"] = step_lib.make_train_step(cfg, TrainConfig(), optimizer, s_shard, b_shard)
    case["args"], case["module"] = (case["state"], case["batch"]), "jit_train_step"
  else:
    case["batch"], b_shard = _rl_batch(mesh, rules, rows, stage.seq, cfg)
    ref = _sds(abstract_params, p_shard)
    case["fn"] = rl_step_lib.make_rl_step(cfg, RL_CONFIG(), optimizer, s_shard, b_shard, p_shard)
    case["args"], case["module"] = (case["state"], case["batch"], ref), "jit_rl_step"
  case["b_shard"] = b_shard
  return case


def measure(compiled, case: dict, dump_dir: str | None) -> dict:
  """Per-device memory (memory_analysis) and collectives (compiled HLO, program dtypes if dumped) in bytes."""
  mem = compiled.memory_analysis()
  dtypes = None
  if dump_dir:
    dtypes = hlo_collectives.program_dtypes(hlo_collectives.partitioned_text(dump_dir, case["module"]))
  parsed = hlo_collectives.parse(compiled.as_text(), dtypes, case["mesh"].size, H200["devices_per_node"])
  colls = hlo_collectives.summarize(parsed)
  # Of those, the ones our shard_map regions issue (EP exchanges, the ring); the rest the SPMD partitioner inserts.
  region = hlo_collectives.summarize(parsed, op_name_contains="shard_map")
  state, batch = case["args"][0], case["args"][1]
  return {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
          "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes,
          "params_opt": _per_device_bytes(state.params) + _per_device_bytes(state.opt_state),
          "ref_params": _per_device_bytes(case["args"][2]) if len(case["args"]) > 2 else 0,
          "batch": _per_device_bytes(batch), "collectives": colls, "region_collectives": region,
          "tokens": case["rows"] * batch["tokens"].shape[1],
          "rows": case["rows"]}


def compile_case(variant: str, stage: Stage, axes: dict[str, int], n_moe_layers: int, dump_dir: str | None,
                 devices=None) -> dict:
  """Compiles one stage's step on one mesh; returns per-device memory and collective figures (bytes)."""
  import jax
  case = build_case(variant, stage, axes, n_moe_layers, devices)
  with jax.set_mesh(case["mesh"]):
    compiled = case["fn"].lower(*case["args"]).compile()
  return measure(compiled, case, dump_dir)


def compile_for_run(variant: str, stage: Stage, axes: dict[str, int], n_moe_layers: int, seed: int = 0):
  """An LM case with real arrays: (compiled step, state, batch, its `measure` figures) to run and compare."""
  import jax
  import numpy as np

  from composer_jax import model
  from composer_jax.train import step as step_lib
  if stage.step != "lm":
    raise ValueError(f"compile_for_run builds LM steps only, got stage step {stage.step!r}")
  case = build_case(variant, stage, axes, n_moe_layers)
  cfg, seq = case["cfg"], stage.seq
  with jax.set_mesh(case["mesh"]):
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
  """One process per device count: compiles its cases at each depth and prints one JSON line per case."""
  import jax
  n = jax.device_count()
  for name in args.stages:
    axes = args.mesh or MESHES[name][n]
    stage = dataclasses.replace(STAGES[name], seq=args.seq or STAGES[name].seq)
    out = {"stage": name, "devices": n, "axes": axes, "seq": stage.seq, "by_depth": {}}
    for d in args.depths:
      out["by_depth"][d] = compile_case(args.variant, stage, axes, d, args.dump_dir)
    print("CASE " + json.dumps(out), flush=True)


# ----- extrapolation, roofline, table (parent process) -----

def _flatten(row: dict, prefix: str = "") -> dict[str, float]:
  out = {}
  for k, v in row.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(v, (int, float)):
      out[f"{prefix}{k}"] = float(v)
  return out


def _unflatten(flat: dict[str, float]) -> dict:
  out: dict = {}
  for k, v in flat.items():
    *path, leaf = k.split(".")
    d = out
    for p in path:
      d = d.setdefault(p, {})
    d[leaf] = v
  return out


def extrapolate(by_depth: dict[int, dict], target: int) -> dict:
  """Every per-device figure on the straight line through the two shallowest depths, evaluated at `target`."""
  d1, d2 = sorted(by_depth)[:2]
  f1, f2 = _flatten(by_depth[d1]), _flatten(by_depth[d2])
  return _unflatten({k: f2[k] + (target - d2) * (f2[k] - f1[k]) / (d2 - d1) for k in f1})


def depth_deviation(by_depth: dict[int, dict]) -> dict[str, float]:
  """Largest |measured - linear prediction| / measured over the deeper compiles, per figure (linearity check)."""
  depths = sorted(by_depth)
  out = {}
  for d in depths[2:]:
    pred, meas = _flatten(extrapolate(by_depth, d)), _flatten(by_depth[d])
    for k in ("argument", "temp", "output", "params_opt", *(f"collectives.{c}.buffer_bytes" for c in
                                                             by_depth[d]["collectives"])):
      if meas[k]:
        out[k] = max(out.get(k, 0.0), abs(meas[k] - pred[k]) / meas[k])
  return out


def model_flops_per_token(cfg, seq: int) -> float:
  """Forward matmul FLOPs per token: 2 x active params + causal attention over `seq`."""
  from composer_jax import model
  _, active = model.count_params(cfg)
  attn = cfg.num_hidden_layers * 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq / 2
  return 2 * active + attn


def roofline(row: dict, stage: Stage, variant: str, n_layers_moe: int, n_devices: int) -> dict:
  """Step-time lower bound and MFU upper bound for one extrapolated row (per device figures)."""
  cfg = dataclasses.replace(plan_model_config(variant, n_layers_moe, stage.seq), scan_layers=True)
  fwd = model_flops_per_token(cfg, stage.seq) * row["tokens"] / n_devices
  n = LM_FORWARDS if stage.step == "lm" else RL_FORWARDS
  useful, executed = n * fwd, (n + cfg.remat) * fwd
  c = row["collectives"]
  t = {"compute": executed / H200["bf16_flops"],
       "memory": (row["argument"] + row["output"] + 2 * row["temp"]) / H200["hbm_bw"],
       "comm": sum(v["nvlink_bytes"] / H200["nvlink_bw"] + v["ib_bytes"] / H200["ib_bw"] for v in c.values())}
  step = max(t.values())
  return {"t": t, "step_s": step, "limit": max(t, key=t.get), "mfu_bound": useful / (step * H200["bf16_flops"]),
          "tokens_per_s": row["tokens"] / step}


def summarize_case(case: dict, variant: str, n_moe_layers: int) -> dict:
  stage = dataclasses.replace(STAGES[case["stage"]], seq=case["seq"])
  row = extrapolate({int(k): v for k, v in case["by_depth"].items()}, n_moe_layers)
  total = row["argument"] + row["temp"] + row["output"] - row["alias"]
  budget = H200["hbm_bytes"] * (1 - HEADROOM)
  r = {"stage": case["stage"], "devices": case["devices"], "axes": case["axes"], "seq": case["seq"],
       "measured_by_depth": case["by_depth"], **row, "total": total,
       "fits": total <= budget, "budget": budget, **roofline(row, stage, variant, n_moe_layers, case["devices"])}
  if len(case["by_depth"]) > 2:
    r["depth_deviation"] = depth_deviation({int(k): v for k, v in case["by_depth"].items()})
  return r


def _mesh_str(axes: dict[str, int]) -> str:
  return "x".join(f"{k}={v}" for k, v in axes.items() if v > 1)


def print_table(rows: list[dict]) -> None:
  gb = 1e9
  print(f"Per device, extrapolated to 61 layers; fits: total <= {H200['hbm_bytes'] / gb:.0f} GB x "
        f"(1 - {HEADROOM:.0%}). Collectives: wire GB per step (NVLink / IB).")
  head = (f"{'stage':13} {'devices':>7} {'mesh':26} {'params+opt':>10} {'temp':>8} {'total':>8} {'fits':>5} "
          f"{'all-gather':>13} {'reduce-scat':>13} {'all-reduce':>13} {'all-to-all':>13} {'permute':>13} "
          f"{'t_comp':>7} {'t_mem':>6} {'t_comm':>7} {'limit':>8} {'MFU<=':>6}")
  print(head)
  for r in rows:
    c = r["collectives"]
    cs = " ".join(f"{c[k]['nvlink_bytes'] / gb:6.0f}/{c[k]['ib_bytes'] / gb:<6.0f}" for k in
                  ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"))
    print(f"{r['stage']:13} {r['devices']:>7} {_mesh_str(r['axes']):26} {r['params_opt'] / gb:10.1f} "
          f"{r['temp'] / gb:8.1f} {r['total'] / gb:8.1f} {'yes' if r['fits'] else 'NO':>5} {cs} "
          f"{r['t']['compute']:7.2f} {r['t']['memory']:6.2f} {r['t']['comm']:7.2f} {r['limit']:>8} "
          f"{r['mfu_bound']:6.1%}")


def markdown_table(rows: list[dict]) -> str:
  """The plan as a markdown table (what composer_jax/parallel/README.md shows, generated once from --out files)."""
  gb = 1e9
  lines = ["| stage | devices | mesh | params + opt GB | temp GB | total GB | fits | all-to-all GB | all-gather GB | "
           "all-reduce GB | permute GB | t compute / memory / comm s | limit | MFU bound |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

  def wire(c):
    return f"{(c['nvlink_bytes'] + c['ib_bytes']) / gb:.0f} ({c['ib_bytes'] / gb:.0f} IB)"
  for r in rows:
    c, t = r["collectives"], r["t"]
    lines.append(f"| {r['stage']} | {r['devices']} | {_mesh_str(r['axes'])} | {r['params_opt'] / gb:.1f} | "
                 f"{r['temp'] / gb:.1f} | {r['total'] / gb:.1f} | {'yes' if r['fits'] else 'no'} | "
                 f"{wire(c['all-to-all'])} | {wire(c['all-gather'])} | {wire(c['all-reduce'])} | "
                 f"{wire(c['collective-permute'])} | {t['compute']:.2f} / {t['memory']:.2f} / {t['comm']:.2f} | "
                 f"{r['limit']} | {r['mfu_bound']:.1%} |")
  return "\n".join(lines)


def run_children(args) -> list[dict]:
  """One subprocess per device count (the fake device count is fixed when jax starts)."""
  cases = []
  for n in args.devices:
    stages = [s for s in args.stages if args.mesh or n in MESHES[s]]
    with tempfile.TemporaryDirectory() as dump:
      env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={n} " + hlo_collectives.dump_flags(dump)
                 # LLVM's optimisation level changes code, not buffers or collectives: -O0 compiles faster.
                 + " --xla_backend_optimization_level=0")
      cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", args.variant, "--dump_dir", dump,
             "--stages", *stages, "--depths", ",".join(map(str, args.depths)), "--seq", str(args.seq or 0)]
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
                "total_gb": round(fit[0]["total"] / 1e9, 1)} if fit else None)
  depth = {f"{r['stage']}@{r['devices']}": r["depth_deviation"] for r in rows if "depth_deviation" in r}
  summary = {"variant": variant, "smallest_fitting": best, "depth_check": depth,
             "not_compiled": [s for s in STAGES if s not in best],
             "load_avg": [round(x, 2) for x in load],
             "rows": [{"stage": r["stage"], "devices": r["devices"], "mesh": _mesh_str(r["axes"]),
                       "total_gb": round(r["total"] / 1e9, 1), "fits": r["fits"],
                       "mfu_bound": round(r["mfu_bound"], 4), "limit": r["limit"]} for r in rows]}
  if out:
    with open(out, "w") as f:
      json.dump({"variant": variant, "h200": H200, "headroom": HEADROOM, "load_avg": list(load), "rows": rows,
                 "depth_check": depth, "summary": summary}, f, indent=1)
  print(json.dumps(summary))
  return summary


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="kimi_k2")
  ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
  ap.add_argument("--devices", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024])
  ap.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                  help="MoE layer counts compiled (>= 2; more adds the linearity check)")
  ap.add_argument("--out", help="write the rows as JSON here")
  ap.add_argument("--combine", nargs="+", help="only print the table and JSON of earlier --out files, merged")
  ap.add_argument("--markdown", action="store_true", help="with --combine: print the README's markdown table")
  ap.add_argument("--mesh", type=_parse_mesh, help="one mesh for every stage, e.g. data=2,expert=4 (experiments)")
  ap.add_argument("--seq", type=int, default=0, help="override the stages' row length (experiments)")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--dump_dir", help=argparse.SUPPRESS)
  args = ap.parse_args()
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
  if len(args.depths) < 2:
    ap.error("--depths needs at least two MoE layer counts to extrapolate")
  from composer_jax import configs, model
  from experiments.configs import model as model_configs
  full = configs.from_dict(model.ModelConfig, model_configs.get_config(args.variant).to_dict())
  n_moe = full.num_hidden_layers - full.first_k_dense_replace
  load = os.getloadavg()
  cases = run_children(args)
  report([summarize_case(c, args.variant, n_moe) for c in cases], args.variant, load, args.out)


if __name__ == "__main__":
  main()
