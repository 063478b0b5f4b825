"""RL on a mesh: one RL step and one rollout batch on 1 vs 8 fake devices, and the scale plan's RL step vs the run's.

  PYTHONPATH=. python benchmarks/rl_mesh.py [--rounds=5] [--plan_devices=64] [--full_depth]

Correctness and overhead, not speed: the 8 fake CPU devices share this machine's cores, so the ratio measures what
sharding adds (collectives, partitioned programs), never what 8 real devices would gain.

1. The RL step of `rl.py:colab` (its model, batch shape and RL config, random groups with recorded routing) on one
   device and on data=2 x expert=2 x context=2 (`RunConfig.mesh`'s rules): |delta| of loss, gradient norm and
   params after one step, and the step time of each (medians of alternating rounds after a warm-up).
2. One rollout batch of the run's embedded engine (a group of `samples_per_prompt` seeded samples at T=1) on one
   device, and on the mesh with each `rollout.engine_placement`: the tokens equal?, the logprob gap, the time.
3. In a child process with `--plan_devices` fake devices: the RL step the run builds (`rl.placement.build_rl_step`, from
   a `RunConfig` of `rl.py`'s default config with the plan's model and step shape) and the one
   `benchmarks/scale_plan.py` compiles, on the plan's mesh and rules, lowered: the same program text?
   Kimi K2 at one MoE layer (`--full_depth`: all 60; minutes per lowering here).

The last line is JSON.
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository: the child's PYTHONPATH


def _run_config(variant: str):
  from composer_jax import configs
  from composer_jax.rl.config import RunConfig
  from experiments.configs import rl
  return configs.from_dict(RunConfig, rl.get_config(variant), workdir="/tmp/rl_mesh_benchmark")


def _batch(cfg, seed: int = 0) -> dict:
  """A step's batch of random flat groups, every token's routing recorded."""
  import numpy as np

  from composer_jax.rl import placement
  from composer_jax.rl.batch import make_batch
  rng = np.random.default_rng(seed)
  bcfg = placement.batch_config(cfg)
  n_layers, k, e = bcfg.n_moe_layers, cfg.model.num_experts_per_tok, cfg.model.n_routed_experts
  groups = []
  for _ in range(cfg.rl.groups_per_step):
    group = []
    for _ in range(cfg.rollout.samples_per_prompt):
      n = int(rng.integers(bcfg.length // 4, bcfg.length))
      t = rng.integers(0, cfg.tokenizer.vocab_size, n).astype(np.int32)
      gen = (np.arange(n) >= n // 3).astype(np.int8)
      routed = (rng.permutation(e)[:k][None, None, :] + np.arange(n)[:, None, None]
                + np.arange(n_layers)[None, :, None]) % e
      seg = {"tokens_T": t, "gen_mask_T": gen, "logprobs_T": np.where(gen > 0, -4.0, 0.0).astype(np.float32),
             "versions_T": np.where(gen > 0, 0, -1).astype(np.int32), "turns_T": np.zeros(n, np.int32),
             "routed_TxNxK": routed.astype(np.int32), "prompt_len": n // 3, "turns": [], "ends_with_summary": False}
      group.append({"task_id": "t", "segments": [seg], "reward": float(rng.integers(0, 2)), "metrics": {}})
    groups.append(group)
  return make_batch(groups, bcfg)


def _median_times(fns: dict, rounds: int) -> dict:
  """Each fn timed once per round, alternating, after one warm-up call each; the medians."""
  for f in fns.values():
    f()
  times = {k: [] for k in fns}
  for _ in range(rounds):
    for k, f in fns.items():
      t0 = time.perf_counter()
      f()
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def rl_step(cfg, mesh_cfg, rounds: int) -> dict:
  import jax
  import numpy as np

  from composer_jax import model
  from composer_jax.parallel import mesh as mesh_lib
  from composer_jax.rl import placement
  from composer_jax.rl.placement import build_rl_step
  host = _batch(cfg)
  start = model.init(jax.random.key(0), cfg.model)
  runs = {}
  for name, mesh, rules in (("1", mesh_lib.mesh_from_config(mesh_lib.MeshConfig()), mesh_lib.MeshConfig().rules()),
                            ("8", mesh_lib.mesh_from_config(mesh_cfg), mesh_cfg.rules())):
    step = build_rl_step(cfg, mesh, rules)
    ref = placement.place_tree(start, step.params)
    batch = placement.place_tree(host, step.batch)
    compiled = step.lower(step.init_state(ref), batch, ref).compile()
    state, m = compiled(step.init_state(ref), batch, ref)
    runs[name] = {"compiled": compiled, "step": step, "ref": ref, "batch": batch,
                  "metrics": jax.device_get(m), "params": jax.device_get(state.params)}

  def timed(r):
    def f():
      jax.block_until_ready(r["compiled"](r["step"].init_state(r["ref"]), r["batch"], r["ref"]))
    return f
  times = _median_times({k: timed(r) for k, r in runs.items()}, rounds)
  one, eight = runs["1"], runs["8"]
  params_gap = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(one["params"]),
                                                                jax.tree.leaves(eight["params"])))
  return {"loss_gap": abs(float(one["metrics"]["loss"]) - float(eight["metrics"]["loss"])),
          "grad_norm_gap": abs(float(one["metrics"]["grad_norm"]) - float(eight["metrics"]["grad_norm"])),
          "params_gap": params_gap, "step_s_1": times["1"], "step_s_8": times["8"],
          "overhead_8_over_1": times["8"] / times["1"]}


def rollout(cfg, mesh_cfg, rounds: int) -> dict:
  import jax
  import numpy as np

  from composer_jax import model
  from composer_jax.parallel import mesh as mesh_lib
  from composer_jax.rl import placement, publishers
  from composer_jax.sampling.engine import JaxEngine
  from rollout.engines.protocol import GenerateRequest, SamplingParams
  params = model.init(jax.random.key(0), cfg.model)
  mesh = mesh_lib.mesh_from_config(mesh_cfg)
  sharded = placement.place_tree(params, model.shardings(cfg.model, mesh, mesh_cfg.rules()))
  prompt = tuple(int(t) for t in np.random.default_rng(1).integers(0, cfg.tokenizer.vocab_size, 64))
  reqs = [GenerateRequest(prompt, SamplingParams(temperature=1.0, max_tokens=cfg.harness.max_turn_tokens, seed=i))
          for i in range(cfg.rollout.samples_per_prompt)]
  ecfg = dataclasses.replace(publishers.engine_config(cfg), prefix_cache_bytes=0)   # every call the same work
  engines = {"1": JaxEngine(params, cfg.model, ecfg),
             "8_trainer": JaxEngine(sharded, cfg.model, ecfg, mesh=mesh, placement="trainer"),
             "8_replicas": JaxEngine(sharded, cfg.model, ecfg, mesh=mesh, placement="replicas")}
  outs = {k: e.generate(reqs) for k, e in engines.items()}
  times = _median_times({k: (lambda e=e: e.generate(reqs)) for k, e in engines.items()}, rounds)
  out = {"tokens": sum(len(r.output_ids) for r in outs["1"]), "rollout_s_1": times["1"]}
  for k in ("8_trainer", "8_replicas"):
    out[f"same_tokens_{k}"] = all(np.array_equal(a.output_ids, b.output_ids) for a, b in zip(outs["1"], outs[k]))
    out[f"logprob_gap_{k}"] = max(float(np.max(np.abs(a.logprobs - b.logprobs))) for a, b in zip(outs["1"], outs[k])
                                  if len(a.logprobs) == len(b.logprobs))
    out[f"rollout_s_{k}"] = times[k]
    out[f"overhead_{k}_over_1"] = times[k] / times["1"]
  return out


def plan_child(n_moe_layers: int | None) -> None:
  """In a process with the plan's device count: the run's RL step vs the plan's, lowered on the plan's mesh."""
  import jax

  from benchmarks import scale_plan_cases as sp
  from composer_jax.rl.placement import build_rl_step
  stage = sp.STAGES["rl"]
  axes = sp.PLANS["kimi_k2"]["rl"][jax.device_count()]
  case = sp.build_case("kimi_k2", stage, axes, n_moe_layers)
  base = _run_config("recipe_best")
  run_cfg = dataclasses.replace(
      base, model=case["cfg"], rollout=dataclasses.replace(base.rollout, samples_per_prompt=2),
      harness=dataclasses.replace(base.harness, context_budget=stage.seq, max_segments=1),
      rl=dataclasses.replace(base.rl, rows_per_step=case["rows"], groups_per_step=case["rows"] // 2, pack_rows=0))
  run_step = build_rl_step(run_cfg, case["mesh"], case["rules"])
  with jax.set_mesh(case["mesh"]):
    plan_text = case["fn"].lower(*case["args"]).as_text()
  run_text = run_step.lower(*case["args"]).as_text()
  print(json.dumps({"devices": jax.device_count(), "mesh": axes, "moe_layers": n_moe_layers or "all",
                    "same_program": plan_text == run_text, "program_chars": len(run_text)}))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--plan_devices", type=int, default=64, choices=(64, 256))
  parser.add_argument("--full_depth", action="store_true")
  parser.add_argument("--plan_child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  n_moe = None if args.full_depth else 1
  if args.plan_child:
    plan_child(n_moe)
    return
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"   # before jax is imported
  from composer_jax.parallel import mesh as mesh_lib
  cfg = _run_config("colab")
  mesh_cfg = mesh_lib.MeshConfig(data=2, expert=2, context=2)
  load = os.getloadavg()
  result = {"load_avg": [round(x, 1) for x in load], "mesh": mesh_cfg.axis_sizes(),
            "rl_step": rl_step(cfg, mesh_cfg, args.rounds), "rollout": rollout(cfg, mesh_cfg, args.rounds)}
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.plan_devices}",
         "PYTHONPATH": ROOT}
  cmd = [sys.executable, os.path.abspath(__file__), "--plan_child"] + (["--full_depth"] if args.full_depth else [])
  child = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
  lines = child.stdout.strip().splitlines()
  result["plan"] = json.loads(lines[-1]) if child.returncode == 0 and lines else {"error": child.stderr[-2000:]}
  result["load_avg_end"] = [round(x, 1) for x in os.getloadavg()]
  print(json.dumps(result))


if __name__ == "__main__":
  main()
