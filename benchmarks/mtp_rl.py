"""MTP through RL (issue 51): the drafter's acceptance over an RL run, trained online vs frozen at the start, with
the MTP gradient stopped at the trunk vs let through; and speculative vs plain decoding of the run's own episodes.

  PYTHONPATH=. python benchmarks/mtp_rl.py --arm=stopped --workdir=runs/mtp_rl   # SFT start + RL (first)
  PYTHONPATH=. python benchmarks/mtp_rl.py --arm=through --workdir=runs/mtp_rl   # RL from the same start
  PYTHONPATH=. python benchmarks/mtp_rl.py --arm=decode --workdir=runs/mtp_rl    # k adaptive vs k = 0
  PYTHONPATH=. python benchmarks/mtp_rl.py --arm=report --workdir=runs/mtp_rl    # JSON + plot + the last line

The run is `rl.py:colab,mode=sync` (level-1 repair tasks, the `rl_colab` model) with one MTP module
(`model.num_nextn_predict_layers=1`), which its SFT start trains by self-distillation; RL rolls out speculatively
(`rollout.draft_tokens=2`, adaptive k) and trains the drafter with `rl.mtp_weight=0.3` (the pretraining weight).
Arms, each in its own workdir under --workdir: `stopped` (the default: the MTP loss reaches only the MTP module),
`through` (`rl.mtp_trunk_grad=True`, from `stopped`'s SFT start, `sft.steps=0`). Both log per step
`rl.mtp_start_metrics`: the drafter frozen at the start measured against the same current policy, so one run gives
the online and the frozen drafter on the same policies. Acceptances are measured on the step's rollout tokens at
T = 1: `mtp_acceptance` the expected acceptance of one draft, Σ min(p, q); `mtp_agreement` the top-1 match (the
greedy acceptance rate); the engine's own counts of each policy version (`spec/*`) beside them.

`decode` runs episodes of held-out tasks through the harness with the final policy of `stopped` (its SFT start
while RL has not finished): engines with
k = 0 (plain), k adaptive (0..2) and k fixed at 1 and 2, alternating over `--rounds` rounds after one warm-up round
each (compiles), timing the seconds inside `generate` per episode; tokens per trunk forward from the engines' counts.

`report` writes experiments/results/mtp_rl.json and experiments/results/mtp_rl.png (from that JSON); its last
line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from composer_jax import configs
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs

_HERE = os.path.dirname(os.path.abspath(__file__))

RESULTS = os.path.join(os.path.dirname(_HERE), "experiments", "results")
PER_STEP = ("reward", "pass_rate", "mtp_acceptance", "mtp_agreement", "mtp_start_acceptance", "mtp_start_agreement",
            "mtp_loss", "spec/acceptance_sampled", "spec/tokens_per_forward_sampled", "spec/draft_tokens_mean",
            "spec/decode_tokens_per_s", "kl", "step_s")


def run_config(workdir: str, arm: str, steps: int, workspaces: str = "sandbox", sft_tasks: int = 1024,
               sft_steps: int = 0) -> RunConfig:
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("colab,mode=sync"), workdir=os.path.join(workdir, arm))
  over = {"model.num_nextn_predict_layers": 1, "rollout.draft_tokens": 2, "rl.mtp_weight": 0.3,
          "rl.mtp_start_metrics": True, "rl.steps": steps, "progress_bar": False,
          "rollout.workspaces": workspaces, "sft.tasks": sft_tasks}
  if sft_steps:
    over["sft.steps"] = sft_steps
  if arm == "through":
    over.update({"rl.mtp_trunk_grad": True, "sft.steps": 0,
                 "sft.init_checkpoint": os.path.join(workdir, "stopped", "sft")})
  return configs.replace(cfg, **over)


def train(workdir: str, arm: str, steps: int, workspaces: str, sft_tasks: int, sft_steps: int) -> None:
  from composer_jax.rl import loop
  # sft.steps and rl.steps may change in a resumed run (the SFT continues from its last checkpoint).
  loop.run_rl(run_config(workdir, arm, steps, workspaces, sft_tasks, sft_steps),
              allow_changes=("sft.steps", "rl.steps"))


def _timed(engine):
  """`engine` with its seconds inside `generate` counted (`engine.seconds`)."""
  inner = engine.generate

  def generate(requests):
    t0 = time.perf_counter()
    out = inner(requests)
    engine.seconds += time.perf_counter() - t0
    return out
  engine.generate, engine.seconds = generate, 0.0
  return engine


def decode(workdir: str, steps: int, episodes: int, rounds: int, workspaces: str, sft_tasks: int,
           sft_steps: int) -> dict:
  """k = 0 vs adaptive vs fixed k on the same held-out episodes with the final `stopped` policy."""
  import dataclasses

  import jax
  import numpy as np

  from composer_jax import model
  from composer_jax.rl import publishers, setup, weight_files
  from composer_jax.sampling.engine import JaxEngine
  from composer_jax.train import stages
  from rollout import harness

  cfg = run_config(workdir, "stopped", steps, workspaces, sft_tasks, sft_steps)
  got = weight_files.latest(publishers.weights_dir(cfg))
  if got is None:   # RL still running: the SFT start (its drafter trained by self-distillation)
    version, params = 0, stages.load_params(os.path.join(cfg.workdir, "sft"), cfg.model)
  else:
    version, path = got
    params = weight_files.load(path, jax.eval_shape(lambda: model.init(jax.random.key(0), cfg.model)))
  tok, envs = setup.load_tokenizer(cfg), setup.make_envs(cfg)
  tasks = setup.heldout_tasks(cfg, episodes)
  base = publishers.engine_config(cfg)
  variants = {"k0": dataclasses.replace(base, speculative=False),
              "adaptive": base,
              "k1": dataclasses.replace(base, adaptive_draft=False, draft_tokens=1),
              "k2": dataclasses.replace(base, adaptive_draft=False, draft_tokens=2)}
  engines = {n: _timed(JaxEngine(params, cfg.model, e, policy_version=version)) for n, e in variants.items()}
  per = {n: [] for n in engines}
  for r in range(rounds + 1):
    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
    for n in order:
      e = engines[n]
      e.seconds, e.version_log.current = 0.0, None
      trajs = harness.run_episodes(e, tok, tasks, envs, cfg.harness)
      line = e.version_log.current or {}
      if r == 0:
        continue   # warm-up: compiles
      gen = sum(int(np.sum(s["gen_mask_T"])) for t in trajs for s in t.to_dict()["segments"])
      sampled = line.get("sampled", {})
      per[n].append({"s_per_episode": e.seconds / len(tasks), "tokens": gen,
                     "tokens_per_forward": ((sampled.get("row_steps", 0) + sampled.get("accepted", 0))
                                            / sampled["row_steps"] if sampled.get("row_steps") else 1.0),
                     "acceptance": (sampled["accepted"] / sampled["drafted"] if sampled.get("drafted") else None),
                     "k_calls": line.get("k_calls", {}),
                     "solved": float(np.mean([t.metrics.get("solved", 0.0) for t in trajs]))})
  out = {}
  for n, rows in per.items():
    med = lambda key, rows=rows: statistics.median(r[key] for r in rows)  # noqa: E731
    out[n] = {"s_per_episode": med("s_per_episode"), "tokens_per_forward": med("tokens_per_forward"),
              "tokens_per_episode": med("tokens") / len(tasks), "solved": med("solved"),
              "acceptance": statistics.median([r["acceptance"] for r in rows if r["acceptance"] is not None] or [0.0]),
              "k_calls": rows[-1]["k_calls"], "rounds": rows}
  for n in engines:
    out[n]["speedup_vs_k0"] = out["k0"]["s_per_episode"] / out[n]["s_per_episode"]
  out["adaptive_chose"] = engines["adaptive"].depth.chosen
  out["adaptive_costs_ms"] = {str(k): engines["adaptive"].depth.step_cost(k, base.min_batch_bucket) * 1e3
                              for k in range(3) if engines["adaptive"].depth.step_cost(k, base.min_batch_bucket)}
  out["acceptance_per_draft"] = engines["adaptive"].depth.acceptance().tolist()
  out["episodes"], out["rounds_timed"], out["policy_version"] = len(tasks), rounds, version
  with open(os.path.join(workdir, "decode.json"), "w") as f:
    json.dump(out, f, indent=1)
  return out


def _read(workdir: str, arm: str) -> list[dict]:
  path = os.path.join(workdir, arm, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _mean(rows, key, part):
  vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
  n = max(1, len(vals) // 5)
  vals = vals[:n] if part == "first" else vals[-n:]
  return float(sum(vals) / len(vals)) if vals else None


def report(workdir: str) -> dict:
  out = {"arms": {}, "load_avg": os.getloadavg()[0]}
  for arm in ("stopped", "through"):
    rows = _read(workdir, arm)
    if not rows:
      continue
    out["arms"][arm] = {"steps": len(rows),
                        "per_step": {k: [r.get(k) for r in rows] for k in PER_STEP},
                        "first_fifth": {k: _mean(rows, k, "first") for k in PER_STEP},
                        "last_fifth": {k: _mean(rows, k, "last") for k in PER_STEP}}
  dpath = os.path.join(workdir, "decode.json")
  if os.path.exists(dpath):
    with open(dpath) as f:
      d = json.load(f)
    out["decode"] = {n: {k: v for k, v in d[n].items() if k != "rounds"} if isinstance(d[n], dict) and n in
                     ("k0", "adaptive", "k1", "k2") else d[n] for n in d}
  os.makedirs(RESULTS, exist_ok=True)
  with open(os.path.join(RESULTS, "mtp_rl.json"), "w") as f:
    json.dump(out, f, indent=1)
  plot(os.path.join(RESULTS, "mtp_rl.json"), os.path.join(RESULTS, "mtp_rl.png"))
  summary = {"load_avg": out["load_avg"]}
  for arm, a in out["arms"].items():
    for key in ("mtp_acceptance", "mtp_start_acceptance", "mtp_agreement", "mtp_start_agreement", "reward"):
      summary[f"{arm}/{key}"] = [a["first_fifth"][key], a["last_fifth"][key]]
  if "decode" in out:
    for n in ("k0", "adaptive", "k1", "k2"):
      summary[f"decode/{n}"] = {k: out["decode"][n][k] for k in ("s_per_episode", "tokens_per_forward",
                                                                   "speedup_vs_k0")}
  return summary


def plot(json_path: str, png: str) -> None:
  """Acceptance per step (10-step means) of the online and the frozen drafter, T = 1 and greedy, per arm."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from composer_jax.train.metrics import moving_average
  with open(json_path) as f:
    d = json.load(f)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, (title, suffix) in zip(axes, (("T = 1: expected acceptance Σ min(p, q)", "acceptance"),
                                        ("greedy: top-1 agreement", "agreement"))):
    for arm, style in (("stopped", "-"), ("through", ":")):
      if arm not in d["arms"]:
        continue
      ps = d["arms"][arm]["per_step"]
      for key, label in ((f"mtp_{suffix}", "online"), (f"mtp_start_{suffix}", "frozen at start")):
        vals = [v for v in ps[key] if v is not None]
        ax.plot(range(1, len(vals) + 1), moving_average(vals, 10), style, label=f"{label} ({arm})")
      if suffix == "acceptance":
        eng = [(i + 1, v) for i, v in enumerate(ps["spec/acceptance_sampled"]) if v is not None]
        if eng and arm == "stopped":
          ax.plot(*zip(*eng), ".", alpha=0.4, label="engine, per version (stopped)")
    ax.set_title(title)
    ax.set_xlabel("RL step (policy version)")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("acceptance of one draft")
  for ax in axes:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--arm", required=True, choices=("stopped", "through", "decode", "report"))
  ap.add_argument("--workdir", default="runs/mtp_rl")
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--episodes", type=int, default=16)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--workspaces", default="sandbox", help="'local': episodes without bubblewrap (faster under load)")
  ap.add_argument("--sft_tasks", type=int, default=1024, help="oracle demonstrations for the SFT start")
  ap.add_argument("--sft_steps", type=int, default=0, help="SFT steps of the start (0: the config's 900)")
  args = ap.parse_args()
  print(f"load average {os.getloadavg()}")
  if args.arm in ("stopped", "through"):
    t0 = time.time()
    train(args.workdir, args.arm, args.steps, args.workspaces, args.sft_tasks, args.sft_steps)
    result = {"arm": args.arm, "minutes": (time.time() - t0) / 60}
  elif args.arm == "decode":
    result = decode(args.workdir, args.steps, args.episodes, args.rounds, args.workspaces, args.sft_tasks,
                    args.sft_steps)
    result = {n: ({k: v for k, v in r.items() if k != "rounds"} if isinstance(r, dict) else r)
              for n, r in result.items()}
  else:
    result = report(args.workdir)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
