r"""Training steps compiled (never run) for H200 clusters, at full depth: memory per device, collectives, roofline.

  PYTHONPATH=. python benchmarks/scale_plan.py                          # kimi_k2: every stage x mesh of PLANS
  PYTHONPATH=. python benchmarks/scale_plan.py --variant moonlight_16b  # the ~16B / ~3B-active shape on one node
  PYTHONPATH=. python benchmarks/scale_plan.py --stages pretrain_32k --devices 64 --out plan_64.json
  PYTHONPATH=. python benchmarks/scale_plan.py --combine plan_*.json [--markdown]  # merge runs: table and last line

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

Rows are judged by `scale_plan_roofline.py` (the H200 roofline and budget, sources there); the steps, meshes
and rules are in `scale_plan_cases.py`.

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

from benchmarks import hlo_costs
from benchmarks.scale_plan_cases import PLANS, STAGES, compile_case
from benchmarks.scale_plan_roofline import H200, markdown_table, report, summarize_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository: the child's PYTHONPATH


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

