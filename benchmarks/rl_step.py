r"""The RL step against the LM train step on the same rows, and the compile time of `model.init`, in one process.

  PYTHONPATH=. python benchmarks/rl_step.py [--variant colab] [--batch 8] [--seq 256] [--prompt 64] [--steps 3]
      [--rounds 5]

Both steps are built as their trainers build them (explicit shardings, the state donated) on the same model
(MTP off: the RL policy does not train MTP heads by default, and the LM step is run with mtp_loss='none'), the same
[B, L] tokens, and the same optimizer. The RL batch marks the first `--prompt` tokens of each row as the prompt, the
rest as generated; its engine logprobs and routing are the policy's own (one forward), recorded at every position —
what the JAX and SGLang engines report — so with router replay on the step runs the reference and policy forwards
and one backward (`rl_step`, `unreplayed_every=0`). `rl_step_with_unreplayed` runs the unreplayed forward (pass 2)
every step as well, which is what a step costs when its metric is due (every `RLConfig.unreplayed_every` steps) or
routing is missing.

Method: the implementations alternate over `--rounds` rounds of `--steps` steps each after 2 warm-up steps; figures
are medians over rounds, the load average (1 min) is printed beside them; each step is timed in wall seconds and in
process CPU seconds (`*_cpu` ratios: the work a step needs, which a shared machine's load moves far less than wall
time). `init_compile_s` is the median over 3
calls of `model.init` on the full config (MTP included) in this process, each after `jax.clear_caches()` (trace +
compile + run; the persistent compilation cache is off). Last line: JSON with `rl_step_vs_train_step`,
`init_compile_s` and the rest.
"""
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import train_step as lm_bench
from composer_jax import configs, model
from composer_jax.rl import losses as rl_losses
from composer_jax.rl import placement
from composer_jax.rl import step as rl_step
from composer_jax.train import loop, optim, step
from composer_jax.train.config import OptimConfig
from experiments.configs import model as model_configs

jax.config.update("jax_enable_compilation_cache", False)


def init_compile_s(cfg, repeats=3) -> float:
  times = []
  for i in range(repeats):
    jax.clear_caches()
    t = time.perf_counter()
    jax.block_until_ready(model.init(jax.random.key(i), cfg))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def rl_batch(cfg, params, lm, prompt: int, group: int = 4, seed: int = 0) -> dict:
  """The LM batch's rows as an RL batch: the policy's own logprobs and routing recorded at every position."""
  B, L = lm["tokens"].shape
  tokens = jnp.asarray(lm["tokens"])
  h, aux = jax.jit(lambda p, t: model.hidden_states(p, t, cfg))(params, tokens)
  logp = jax.jit(rl_losses.token_logprobs)(h, model.lm_head(params, cfg), tokens)
  reward = np.random.default_rng(seed).integers(0, 2, B).astype(np.float32)
  gen = (np.arange(L) >= prompt).astype(np.float32)
  return {"tokens": lm["tokens"], "segment_ids": lm["segment_ids"], "positions": lm["positions"],
          "seq": np.broadcast_to(np.arange(B, dtype=np.int32)[:, None], (B, L)).copy(),
          "gen_mask": np.broadcast_to(gen, (B, L)).copy(), "inf_logprobs": np.asarray(logp),
          "routing": np.asarray(aux["experts"]), "reward": reward, "passed": reward,
          "group": (np.arange(B) // group).astype(np.int32), "first": np.ones(B, np.float32),
          "valid": np.ones(B, np.float32), "is_cap": np.full(B, 2.0, np.float32), "staleness": np.zeros(B, np.int32),
          "traj_gen_tokens": np.full(B, L - prompt, np.float32)}


def rl_runner(cfg, params, batch, rl_cfg):
  """`rl_step` as `rl.trainer` builds it; returns run(n) → (wall, CPU) seconds per step (after 2 warm-up steps)."""
  mesh = loop.single_device_mesh()
  p_shard = model.shardings(cfg, mesh)
  opt = optim.make_optimizer(OptimConfig(), params, frozen=("mtp",))
  shardings = step.state_shardings(opt, params, p_shard)
  box = [step.init_state(params, opt), None]
  ref = jax.tree.map(jnp.copy, params)
  bsh = placement.batch_shardings(mesh)
  batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, bsh)
  fn = rl_step.make_rl_step(cfg, rl_cfg, opt, shardings, bsh, p_shard)

  def one():
    box[0], box[1] = fn(box[0], batch, ref)

  def run(n):
    return lm_bench.timed(one, n, lambda: jax.block_until_ready(box[1]))
  run(2)
  return run


def alternate(run: dict, rounds: int, steps: int) -> tuple[dict, dict, list]:
  """Runs each `run[name](steps)` (→ (wall, CPU) seconds per step) in turn for `rounds` rounds, printing each round
  with the load average; returns (median wall seconds per name, median CPU seconds per name, the loads)."""
  times, cpu, loads = {k: [] for k in run}, {k: [] for k in run}, []
  for r in range(rounds):
    loads.append(os.getloadavg()[0])
    for k, f in run.items():
      wall, cpu_s = f(steps)
      times[k].append(wall)
      cpu[k].append(cpu_s)
    print(f"round {r}: " + "  ".join(f"{k} {times[k][-1]:.3f} s (cpu {cpu[k][-1]:.3f})" for k in run)
          + f"  load {loads[-1]:.1f}")
  return ({k: statistics.median(v) for k, v in times.items()}, {k: statistics.median(v) for k, v in cpu.items()},
          loads)


def main():
  ap = lm_bench.step_args()
  ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row (not trained on)")
  args = ap.parse_args()
  full = configs.from_dict(model.ModelConfig, model_configs.get_config(args.variant).to_dict())
  init_s = init_compile_s(full)
  cfg = configs.from_dict(model.ModelConfig, {**model_configs.get_config(args.variant).to_dict(),
                                              "num_nextn_predict_layers": 0})
  params = model.init(jax.random.key(0), cfg)
  lm = lm_bench.lm_batch(cfg, args.batch, args.seq)
  batch = rl_batch(cfg, params, lm, args.prompt)
  run = {"train_step": lm_bench.ours(cfg, params, lm)[0],
         "rl_step": rl_runner(cfg, params, batch, rl_step.RLConfig(unreplayed_every=0)),
         "rl_step_with_unreplayed": rl_runner(cfg, params, batch, rl_step.RLConfig(unreplayed_every=1))}
  med, med_cpu, loads = alternate(run, args.rounds, args.steps)
  result = {"variant": args.variant, "batch": args.batch, "seq": args.seq, "prompt": args.prompt,
            "rounds": args.rounds, "steps_per_round": args.steps,
            "rl_step_vs_train_step": med["rl_step"] / med["train_step"],
            "rl_step_with_unreplayed_vs_train_step": med["rl_step_with_unreplayed"] / med["train_step"],
            "rl_step_s": med["rl_step"], "rl_step_with_unreplayed_s": med["rl_step_with_unreplayed"],
            "train_step_s": med["train_step"], "init_compile_s": init_s,
            "rl_step_vs_train_step_cpu": med_cpu["rl_step"] / med_cpu["train_step"],
            "rl_step_with_unreplayed_vs_train_step_cpu": med_cpu["rl_step_with_unreplayed"] / med_cpu["train_step"],
            "load_average": statistics.mean(loads), "load_average_end": os.getloadavg()[0]}
  lm_bench.report(result)


if __name__ == "__main__":
  main()
