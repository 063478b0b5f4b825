"""MTP through RL (issue 51): the drafter's acceptance over an RL run, trained online vs frozen at the start, with
the MTP gradient stopped at the trunk vs let through; the RL result against the recipe's; and speculative vs plain
decoding of the run's own episodes.

  python benchmarks/mtp_rl.py --arm=start   --workdir=runs/mtp_rl             # the shared SFT start (first)
  python benchmarks/mtp_rl.py --arm=stopped --workdir=runs/mtp_rl --seed=0    # RL from it + held-out evaluation
  python benchmarks/mtp_rl.py --arm=through --workdir=runs/mtp_rl --seed=0    # the trunk gradient let through
  python benchmarks/mtp_rl.py --arm=decode  --workdir=runs/mtp_rl             # k adaptive vs k = 0
  python benchmarks/mtp_rl.py --arm=report  --workdir=runs/mtp_rl             # JSON + plot + the last line

(with PYTHONPATH at the repository root). `--recipe=default` (the default) is the default run (`make run`:
`experiments/configs/rl.py`'s default variant, levels 1-3, 300 RL steps, 500 held-out tasks per level);
`--recipe=colab` is `rl.py:colab,mode=sync` (level 1, minutes). Both with one MTP module
(`model.num_nextn_predict_layers=1`), which the start's SFT trains by self-distillation (`benchmarks/rl_from_start.py`).

Arms, each in its own workdir under --workdir (`start`, `<arm>_seed<seed>`), RL from the start
(`sft.init_checkpoint`, `sft.steps=0`) with speculative rollouts (`rollout.draft_tokens=2`, adaptive k) and the drafter
trained with `rl.mtp_weight=0.3` (the pretraining weight): `stopped` (the default: the MTP loss reaches only the MTP
module), `through` (`rl.mtp_trunk_grad=True`). Both log per step `rl.mtp_start_metrics`: the drafter frozen at the
start measured against the same current policy, so one run gives the online and the frozen drafter on the same
policies. Acceptances are measured on the step's rollout tokens at T = 1: `mtp_acceptance` the expected acceptance
of one draft, Σ min(p, q); `mtp_agreement` the top-1 match (the greedy acceptance rate); the engine's own counts of
each policy version (`spec/*`) beside them. Each arm ends with the held-out evaluation of its final policy (greedy
and T=1, per level), the figure the recipe's recorded runs are compared on.

`decode` runs episodes of held-out tasks through the harness with the final policy of `stopped` seed 0 (the start
while RL has not finished): engines with k = 0 (plain), k adaptive (0..2) and k fixed at 1 and 2, alternating over
`--rounds` rounds after one warm-up round each (compiles), timing the seconds inside `generate` per episode (compiles
of programs first met in a timed round included, and counted per round) and the tokens per second of the calls'
programs with compiles left out (the rate of an engine that has met its programs, as an RL run's engines soon have);
tokens per trunk forward from the engines' counts. Then the split's own cost: the engine runs a call as two programs
(prefill, then decode, so the decode is timed alone); the same two composed into one program, as the engine ran a
call before, on the first two calls of the episodes (a full prefill, then a window over reused rows), k = 0, 1, 2,
alternated over `--rounds` rounds after a warm-up, medians.

`report` writes experiments/results/mtp_rl.json and experiments/results/mtp_rl.png (from that JSON) from whatever
the runs have reached (an arm still running: its steps so far, `finished` false); its last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks import rl_from_start
from composer_jax import configs
from composer_jax.rl.config import RunConfig

_HERE = os.path.dirname(os.path.abspath(__file__))

RESULTS = os.path.join(os.path.dirname(_HERE), "experiments", "results")
PER_STEP = ("reward", "pass_rate", "mtp_acceptance", "mtp_agreement", "mtp_start_acceptance", "mtp_start_agreement",
            "mtp_loss", "spec/acceptance_sampled", "spec/tokens_per_forward_sampled", "spec/draft_tokens_mean",
            "spec/decode_tokens_per_s", "kl", "step_s")
ARMS = ("stopped", "through")
MTP = {"rollout.draft_tokens": 2, "rl.mtp_weight": 0.3, "rl.mtp_start_metrics": True}


def start_config(recipe: str, workdir: str) -> RunConfig:
  return rl_from_start.recipe_config(recipe, os.path.join(workdir, "start"))


def arm_dir(workdir: str, arm: str, seed: int) -> str:
  return os.path.join(workdir, f"{arm}_seed{seed}")


def arm_config(recipe: str, workdir: str, arm: str, seed: int) -> RunConfig:
  """RL from the start with speculative rollouts and the drafter trained online; `through`: its gradient also
  reaches the trunk."""
  if arm not in ARMS:
    raise ValueError(f"unknown arm {arm!r}; valid: {ARMS}")
  return rl_from_start.from_start(recipe, os.path.join(workdir, "start"), arm_dir(workdir, arm, seed), seed,
                                  **MTP, **({"rl.mtp_trunk_grad": True} if arm == "through" else {}))


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


def decode(recipe: str, workdir: str, episodes: int, rounds: int) -> dict:
  """k = 0 vs adaptive vs fixed k on the same held-out episodes with the final `stopped` seed-0 policy."""
  import jax

  from composer_jax import model
  from composer_jax.rl import publishers, setup, weight_files
  from composer_jax.train import stages

  cfg = arm_config(recipe, workdir, "stopped", 0)
  got = weight_files.latest(publishers.weights_dir(cfg))
  if got is None:   # RL still running: the start (its drafter trained by self-distillation)
    version, params = 0, stages.load_params(cfg.sft.init_checkpoint, cfg.model)
  else:
    version, path = got
    params = weight_files.load(path, jax.eval_shape(lambda: model.init(jax.random.key(0), cfg.model)))
  with setup.open_run(configs.replace(cfg, **{"eval.tasks": episodes})) as run:
    return _decode(cfg, params, version, run.tokenizer, run.heldout, run.envs, rounds, workdir)


def _recording(engine, calls: list, n: int):
  """`engine` with the requests of its first `n` calls appended to `calls`."""
  inner = engine.generate

  def generate(requests):
    if len(calls) < n:
      calls.append(list(requests))
    return inner(requests)
  engine.generate = generate
  return engine


def split_overhead(engine, calls: list, rounds: int) -> dict:
  """Seconds per call of the engine's two programs (prefill, then decode, each run to completion) against the same
  two composed into one program, on `calls` in order (each after the previous one's output entered the prefix cache,
  so later calls prefill windows), for every k up to the engine's: medians over `rounds` alternated rounds after a
  warm-up (compiles)."""
  import functools

  import jax

  from composer_jax.sampling import engine as engine_lib

  @functools.partial(jax.jit, static_argnames=("cfg", "max_len", "draft_tokens", "slots", "window", "hidden"))
  def one_program(params, batch, cfg, max_len, draft_tokens, slots, window, hidden):
    cache, logits, h, experts = engine_lib._prefill(params, batch, cfg, slots, window, hidden)
    out = engine_lib._decode(params, batch._replace(prefix_cache=None, prefix_experts_LmxUxPxK=None), cache, logits,
                             h, cfg, max_len, draft_tokens)
    return out._replace(prompt_experts_LmxUxPxK=experts)

  batches = []
  engine.prefix_cache.clear()
  for requests in calls:
    batch, Lo, window = engine._batch(requests)
    batches.append((batch, Lo, engine.prefill_static(batch.prompts_UxP.shape[1], Lo, window)))
    engine.generate(requests)
  ks = range(engine._draft_tokens + 1)
  times = {(i, k, how): [] for i in range(len(batches)) for k in ks for how in ("one", "two")}
  for r in range(rounds + 1):
    for (i, k, how) in (list(times) if r % 2 == 0 else list(times)[::-1]):
      batch, Lo, static = batches[i]
      t0 = time.perf_counter()
      if how == "one":
        jax.device_get(one_program(engine.params, batch, engine.cfg, Lo, k, **static))
      else:
        (cache, logits, h, experts), _, _ = engine._program(engine_lib._prefill, (batch,), **static)
        args = (batch._replace(prefix_cache=None, prefix_experts_LmxUxPxK=None), cache, logits, h)
        out, _, _ = engine._program(engine_lib._decode, args, max_len=Lo, draft_tokens=k)
        jax.device_get(out._replace(prompt_experts_LmxUxPxK=experts))
      if r:
        times[(i, k, how)].append(time.perf_counter() - t0)
  out = {}
  for i, (_, _, static) in enumerate(batches):
    for k in ks:
      one, two = (statistics.median(times[(i, k, how)]) for how in ("one", "two"))
      out[f"call{i}_window{static['window']}_k{k}"] = {"one_program_s": one, "two_programs_s": two,
                                                        "two_over_one": two / one}
  out["median_two_over_one"] = statistics.median(v["two_over_one"] for v in out.values())
  out["rounds"], out["load_avg"] = rounds, os.getloadavg()
  return out


def _decode(cfg, params, version, tok, tasks, envs, rounds, workdir) -> dict:
  import dataclasses

  import numpy as np

  from composer_jax.rl import publishers
  from composer_jax.sampling.engine import JaxEngine
  from rollout import harness

  base = publishers.engine_config(cfg)
  variants = {"k0": dataclasses.replace(base, speculative=False),
              "adaptive": base,
              "k1": dataclasses.replace(base, adaptive_draft=False, draft_tokens=1),
              "k2": dataclasses.replace(base, adaptive_draft=False, draft_tokens=2)}
  choices: list[str] = []
  engines = {n: _timed(JaxEngine(params, cfg.model, e, policy_version=version, name=n, log_fn=choices.append))
             for n, e in variants.items()}
  first_calls: list = []
  _recording(engines["k0"], first_calls, 2)
  per = {n: [] for n in engines}
  for r in range(rounds + 1):
    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
    for n in order:
      e = engines[n]
      e.seconds, e.version_log.current = 0.0, None
      compiles, compile_s = e.compiles, e.compile_s
      trajs = harness.run_episodes(e, tok, tasks, envs, cfg.harness)
      line = e.version_log.current or {}
      if r == 0:
        continue   # warm-up: compiles
      gen = sum(int(np.sum(s["gen_mask_T"])) for t in trajs for s in t.to_dict()["segments"])
      sampled = line.get("sampled", {})
      per[n].append({"s_per_episode": e.seconds / len(tasks), "tokens": gen,
                     "compiles": e.compiles - compiles, "compile_s": e.compile_s - compile_s,
                     # the calls' programs without their compiles: the rate of an engine that has compiled them
                     "timed_tokens_per_s": (line["timed_tokens"] / line["decode_s"] if line.get("decode_s")
                                            else None),
                     "tokens_per_forward": ((sampled.get("row_steps", 0) + sampled.get("accepted", 0))
                                            / sampled["row_steps"] if sampled.get("row_steps") else 1.0),
                     "acceptance": (sampled["accepted"] / sampled["drafted"] if sampled.get("drafted") else None),
                     "k_calls": line.get("k_calls", {}),
                     "solved": float(np.mean([t.metrics.get("solved", 0.0) for t in trajs]))})
  out = {}
  for n, rows in per.items():
    med = lambda key, rows=rows: statistics.median(r[key] for r in rows)  # noqa: E731
    timed = [r["timed_tokens_per_s"] for r in rows if r["timed_tokens_per_s"]]
    out[n] = {"s_per_episode": med("s_per_episode"), "tokens_per_forward": med("tokens_per_forward"),
              "timed_tokens_per_s": statistics.median(timed) if timed else None,
              "tokens_per_episode": med("tokens") / len(tasks), "solved": med("solved"),
              "acceptance": statistics.median([r["acceptance"] for r in rows if r["acceptance"] is not None] or [0.0]),
              "k_calls": rows[-1]["k_calls"], "compiles_timed_rounds": sum(r["compiles"] for r in rows),
              "compiles": engines[n].compiles, "compile_s": engines[n].compile_s, "rounds": rows}
  for n in engines:
    out[n]["speedup_vs_k0"] = out["k0"]["s_per_episode"] / out[n]["s_per_episode"]
    if out[n]["timed_tokens_per_s"] and out["k0"]["timed_tokens_per_s"]:
      out[n]["timed_speedup_vs_k0"] = out[n]["timed_tokens_per_s"] / out["k0"]["timed_tokens_per_s"]
  depth = engines["adaptive"].depth
  out["adaptive_chose"], out["adaptive_log"] = depth.chosen, choices
  # each k's decode tokens/s over the chosen k's, on the recent calls that decoded with both
  out["adaptive_rates_vs_chosen"] = {str(k): depth.relative_rate(k, depth.chosen) for k in range(3)
                                     if k != depth.chosen}
  out["acceptance_per_draft"] = depth.acceptance().tolist()
  out["split_overhead"] = split_overhead(engines["k2"], first_calls, rounds)
  out["episodes"], out["rounds_timed"], out["policy_version"] = len(tasks), rounds, version
  out["load_avg_end"] = os.getloadavg()
  with open(os.path.join(workdir, "decode.json"), "w") as f:
    json.dump(out, f, indent=1)
  return out


def _mean(rows, key, part):
  vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
  n = max(1, len(vals) // 5)
  vals = vals[:n] if part == "first" else vals[-n:]
  return float(sum(vals) / len(vals)) if vals else None


def start_drafter(start_dir: str) -> dict:
  """The SFT start's self-distilled drafter as its SFT last logged it (`mtp1_agreement`: top-1 agreement with the
  trunk on the SFT rows), per SFT stage that has logged (the curriculum's first stage, then the start)."""
  out = {}
  for stage in ("sft_curriculum", "sft"):
    rows = rl_from_start.logged_steps(os.path.join(start_dir, stage))
    if rows:
      out[stage] = {k: rows[-1].get(k) for k in ("step", "mtp1_agreement", "mtp1_loss", "ce")}
  return out


def report(workdir: str, name: str, seeds=(0, 1)) -> dict:
  out = {"arms": {}, "load_avg": os.getloadavg()}
  start = rl_from_start.done(os.path.join(workdir, "start"))
  if start is not None:
    out["start"] = start
  out["start_sft"] = start_drafter(os.path.join(workdir, "start"))
  for arm in ARMS:
    for seed in seeds:
      rows = rl_from_start.logged_steps(arm_dir(workdir, arm, seed))
      if not rows:
        continue
      final = rl_from_start.done(arm_dir(workdir, arm, seed))
      out["arms"][f"{arm}_seed{seed}"] = {
          "steps": len(rows), "finished": final is not None, "result": final,
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
  with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
    json.dump(out, f, indent=1)
  plot(os.path.join(RESULTS, f"{name}.json"), os.path.join(RESULTS, f"{name}.png"))
  summary = {"load_avg": out["load_avg"], "start_sft": out["start_sft"]}
  for arm, a in out["arms"].items():
    for key in ("mtp_acceptance", "mtp_start_acceptance", "mtp_agreement", "mtp_start_agreement", "reward"):
      summary[f"{arm}/{key}"] = [a["first_fifth"][key], a["last_fifth"][key]]
  if "decode" in out:
    for n in ("k0", "adaptive", "k1", "k2"):
      summary[f"decode/{n}"] = {k: out["decode"][n].get(k) for k in ("s_per_episode", "tokens_per_forward",
                                                                       "speedup_vs_k0", "timed_speedup_vs_k0")}
  return summary


def _present(values: list) -> tuple[list[int], list[float]]:
  """The steps (from 1) with a value, and the values."""
  kept = [(i + 1, v) for i, v in enumerate(values) if v is not None]
  return [i for i, _ in kept], [v for _, v in kept]


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
    for arm, a in d["arms"].items():
      ps, style = a["per_step"], ":" if arm.startswith("through") else "-"
      partial = "" if a["finished"] else ", partial"
      for key, label in ((f"mtp_{suffix}", "online"), (f"mtp_start_{suffix}", "frozen at start")):
        steps, vals = _present(ps[key])
        if vals:
          ax.plot(steps, moving_average(vals, 10), style, label=f"{label} ({arm}{partial})")
      if suffix == "acceptance" and arm == "stopped_seed0":
        steps, vals = _present(ps["spec/acceptance_sampled"])
        if vals:
          ax.plot(steps, vals, ".", alpha=0.4, label=f"engine, per version ({arm})")
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
  ap.add_argument("--arm", required=True, choices=("start", *ARMS, "decode", "report"))
  ap.add_argument("--recipe", default="default", choices=sorted(rl_from_start.RECIPES))
  ap.add_argument("--workdir", default="runs/mtp_rl")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--episodes", type=int, default=16)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--name", default="", help="report: experiments/results/<name>.json/.png (default: mtp_rl_recipe "
                  "for the default recipe, mtp_rl for colab)")
  args = ap.parse_args()
  print(f"load average {os.getloadavg()}")
  if args.arm == "start":
    result = rl_from_start.run_start(start_config(args.recipe, args.workdir))
  elif args.arm in ARMS:
    result = rl_from_start.run_arm(arm_config(args.recipe, args.workdir, args.arm, args.seed))
  elif args.arm == "decode":
    result = decode(args.recipe, args.workdir, args.episodes, args.rounds)
    result = {n: ({k: v for k, v in r.items() if k != "rounds"} if isinstance(r, dict) else r)
              for n, r in result.items()}
  else:
    result = report(args.workdir, args.name or ("mtp_rl" if args.recipe == "colab" else "mtp_rl_recipe"))
  print(json.dumps(result))


if __name__ == "__main__":
  main()
