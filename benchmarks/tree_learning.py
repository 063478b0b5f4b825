"""Tree rollouts vs flat groups at equal RL wall-clock (issue 50): from one start, a flat-group RL run and a tree RL
run, then the held-out success of each (greedy and T=1, per level, Wilson 95%), with learning curves.

  python benchmarks/tree_learning.py --arm=flat --start=runs/mtp_rl/start --workdir=runs/tree_learning --seed=0
  python benchmarks/tree_learning.py --arm=tree --start=runs/mtp_rl/start --workdir=runs/tree_learning --seed=0
  python benchmarks/tree_learning.py --arm=report --workdir=runs/tree_learning

(with PYTHONPATH at the repository root). The start is `benchmarks/mtp_rl.py --arm=start`'s (the default recipe
with one MTP module, which these arms leave untrained and unused: `rl.mtp_weight=0`, no speculation). Both arms
train on levels 2 and 3 (`--levels`) of the default recipe with its RL settings and evaluate on 500 held-out tasks
per level. `flat` runs the recipe's RL steps (300); `tree` groups as trees (`--branch_turns`, `--fanouts`: the setting
tree_rollouts_settings.md chose, (0, 2) x (2, 4), the same G = 8 leaves) with the shared prefix stored once
(`rl.share_prefix`), for as many steps as take the flat arm's RL wall-clock of the same seed (its steps' summed
`step_s`; so `flat` runs first). Each arm's workdir is `<arm>_seed<seed>`.

`report` writes experiments/results/tree_rollouts_learning.json/.md/.png from whatever the runs have reached (an
arm still running: its curve so far, marked partial; a finished arm whose workdir is elsewhere: as the JSON there
already holds it); its last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os

from benchmarks import rl_from_start
from composer_jax import configs
from composer_jax.rl.config import RunConfig

_HERE = os.path.dirname(os.path.abspath(__file__))

RESULTS = os.path.join(os.path.dirname(_HERE), "experiments", "results")
NAME = "tree_rollouts_learning"
ARMS = ("flat", "tree")
TREE_MAX_STEPS = 4   # x the recipe's RL steps: the tree arm's cap, should its wall-clock budget not stop it first
CURVE = ("reward", "pass_rate", "generated_tokens", "trajectories", "rollout_s", "step_s")


def arm_dir(workdir: str, arm: str, seed: int) -> str:
  return os.path.join(workdir, f"{arm}_seed{seed}")


def arm_config(recipe: str, start: str, workdir: str, arm: str, seed: int, levels: tuple[int, ...],
               branch_turns: tuple[int, ...], fanouts: tuple[int, ...], per_level: int = 500) -> RunConfig:
  """Flat groups for the recipe's RL steps, or trees (stopped by wall-clock, at most TREE_MAX_STEPS times as many)
  on `levels`."""
  if arm not in ARMS:
    raise ValueError(f"unknown arm {arm!r}; valid: {ARMS}")
  over = {"tasks.levels": levels, "eval.tasks": per_level * len(levels), "rl.mtp_weight": 0.0,
          "rollout.draft_tokens": 0}
  if arm == "tree":
    over.update({"rollout.tree_branch_turns": branch_turns, "rollout.tree_fanouts": fanouts, "rl.share_prefix": True})
  cfg = rl_from_start.from_start(recipe, start, arm_dir(workdir, arm, seed), seed, **over)
  return cfg if arm == "flat" else configs.replace(cfg, **{"rl.steps": TREE_MAX_STEPS * cfg.rl.steps})


def run(cfg: RunConfig, arm: str, workdir: str, seed: int) -> dict:
  if arm == "flat":
    return rl_from_start.run_arm(cfg)
  flat = rl_from_start.done(arm_dir(workdir, "flat", seed))
  if flat is None:
    raise SystemExit(f"the tree arm runs for the flat arm's RL wall-clock: run --arm=flat --seed={seed} first "
                     f"({arm_dir(workdir, 'flat', seed)} has no {rl_from_start.RESULT})")
  return rl_from_start.run_arm(cfg, budget_s=flat["rl_seconds"])


def curve(rows: list[dict]) -> dict:
  """Per logged step: the cumulative RL wall-clock and the step's training figures (levels' pass rates too)."""
  t, out = 0.0, {"seconds": [], "step": []}
  keys = sorted({k for r in rows for k in r if k.startswith("pass/level_")}) + list(CURVE)
  for k in keys:
    out[k] = []
  for r in rows:
    t += r.get("step_s", 0.0)
    out["seconds"].append(t)
    out["step"].append(r["step"])
    for k in keys:
      out[k].append(r.get(k))
  return out


def per_leaf(rows: list[dict]) -> dict:
  """Generated tokens per leaf (trajectory) and wall-clock seconds per RL step (asynchronous rollouts: the step
  waits on them), over the logged steps."""
  trajs = sum(r.get("trajectories", 0) for r in rows)
  gen = sum(r.get("generated_tokens", 0) for r in rows)
  return {"generated_tokens_per_leaf": gen / trajs if trajs else None,
          "step_s_mean": sum(r.get("step_s", 0.0) for r in rows) / len(rows) if rows else None}


def report(workdir: str, seeds=(0, 1), results: str = RESULTS) -> dict:
  """Writes `results`/tree_rollouts_learning.json/.md/.png from the arms' workdirs. A finished arm whose workdir is
  not here (its runs were on another machine) is carried over from the JSON already in `results`, so the report of
  one seed's arms does not drop the other seed's."""
  path = os.path.join(results, f"{NAME}.json")
  before = {}
  if os.path.exists(path):
    with open(path) as f:
      before = json.load(f)["arms"]
  out = {"load_avg": os.getloadavg(), "arms": {}}
  for arm in ARMS:
    for seed in seeds:
      name, rows = f"{arm}_seed{seed}", rl_from_start.logged_steps(arm_dir(workdir, arm, seed))
      if rows:
        final = rl_from_start.done(arm_dir(workdir, arm, seed))
        out["arms"][name] = {"finished": final is not None, "result": final, "steps": len(rows),
                             **per_leaf(rows), "curve": curve(rows)}
      elif before.get(name, {}).get("finished"):
        out["arms"][name] = before[name]
  os.makedirs(results, exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  plot(out, os.path.join(results, f"{NAME}.png"))
  with open(os.path.join(results, f"{NAME}.md"), "w") as f:
    f.write(table(out))
  return {name: {k: a[k] for k in ("finished", "steps", "generated_tokens_per_leaf", "step_s_mean")}
          for name, a in out["arms"].items()}


def _cell(row: dict | None, temp: str, level: str) -> str:
  if not row:
    return "not measured yet"
  r = row[temp]["levels"].get(level) if level else row[temp]
  return f"{r['success']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]" if r else "—"


def _load(result: dict, key: str) -> str:
  return f"{result[key][0]:.1f}" if key in result else "—"


def table(out: dict) -> str:
  """The generated table: per arm, held-out success per level and temperature (Wilson 95%), RL steps and seconds,
  tokens per leaf, rollout seconds per step."""
  lines = [
      "# Tree rollouts vs flat groups at equal RL wall-clock (issue 50)", "",
      f"Written by `benchmarks/tree_learning.py --arm=report` (load average at writing {out['load_avg'][0]:.1f}) from "
      "the runs below; the commands, the start and what the figures mean are in that file's docstring and in "
      "[tree_rollouts.md](tree_rollouts.md). Held-out success: 500 tasks per level, Wilson 95% in brackets. "
      "RL s: the arm's summed step wall-clock on 2 shared cores (its load average beside it). An arm not "
      "finished is a partial run: its held-out cells are not measured yet; [curves](tree_rollouts_learning.png).",
      "", "```bash", "export PYTHONPATH=$PWD",
      "python benchmarks/mtp_rl.py --arm=start --workdir=runs/mtp_rl   # the shared start (the default recipe's SFT)",
      *[f"python benchmarks/tree_learning.py --arm={arm} --seed={seed} --start=runs/mtp_rl/start "
        "--workdir=runs/tree_learning" for seed in (0, 1) for arm in ARMS],
      "python benchmarks/tree_learning.py --arm=report --workdir=runs/tree_learning", "```",
      "", "| arm | finished | RL steps | RL s | generated tokens / leaf | s / RL step | "
           "T0 level 2 | T0 level 3 | T1 level 2 | T1 level 3 | load avg (start → end) |", "|" + "---|" * 11]
  for name, a in out["arms"].items():
    res = a["result"] or {}
    rl = res.get("rl")
    lines.append(
        f"| {name} | {a['finished']} | {a['steps']} | {a['curve']['seconds'][-1]:.0f} | "
        f"{a['generated_tokens_per_leaf'] or 0:.1f} | {a['step_s_mean'] or 0:.1f} | "
        + " | ".join(_cell(rl, t, lv) for t in ("T0", "T1") for lv in ("2", "3"))
        + f" | {_load(res, 'load_avg_start')} → {_load(res, 'load_avg_end')} |")
  if not out["arms"]:
    lines.append("| (no arm has logged an RL step yet: nothing measured yet) |" + " |" * 10)
  return "\n".join(lines) + "\n"


def plot(out: dict, png: str) -> None:
  """Training pass rate per level (20-step means) against RL wall-clock, per arm; held-out T=1 at the end."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from composer_jax.train.metrics import moving_average
  levels = sorted({k for a in out["arms"].values() for k in a["curve"] if k.startswith("pass/level_")})
  fig, axes = plt.subplots(1, max(1, len(levels)), figsize=(5.5 * max(1, len(levels)), 4), sharey=True, squeeze=False)
  for ax, key in zip(axes[0], levels):
    for name, a in out["arms"].items():
      c = a["curve"]
      kept = [(s, v) for s, v in zip(c["seconds"], c.get(key, [])) if v is not None]
      if not kept:
        continue
      xs, ys = zip(*kept)
      style = "-" if name.startswith("tree") else "--"
      line, = ax.plot([x / 60 for x in xs], moving_average(list(ys), 20), style,
                      label=f"{name} (training){'' if a['finished'] else ', partial'}")
      rl = (a["result"] or {}).get("rl")
      level = key.removeprefix("pass/level_")
      if rl and level in rl["T1"]["levels"]:
        r = rl["T1"]["levels"][level]
        ax.errorbar([xs[-1] / 60], [r["success"]], yerr=[[r["success"] - r["ci_low"]], [r["ci_high"] - r["success"]]],
                    fmt="o", color=line.get_color(), label=f"{name} held-out T=1")
    ax.set_title(f"level {key.removeprefix('pass/level_')}")
    ax.set_xlabel("RL wall-clock (min, summed step time)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel("success")
  fig.tight_layout()
  fig.savefig(png, dpi=110)


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--arm", required=True, choices=(*ARMS, "report"))
  ap.add_argument("--recipe", default="default", choices=sorted(rl_from_start.RECIPES))
  ap.add_argument("--start", default="runs/mtp_rl/start", help="the shared start's workdir (mtp_rl.py --arm=start)")
  ap.add_argument("--workdir", default="runs/tree_learning")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--levels", default="2,3")
  ap.add_argument("--per_level", type=int, default=500, help="held-out tasks per level")
  ap.add_argument("--branch_turns", default="0,2")
  ap.add_argument("--fanouts", default="2,4")
  args = ap.parse_args()
  print(f"load average {os.getloadavg()}")
  if args.arm == "report":
    result = report(args.workdir)
  else:
    cfg = arm_config(args.recipe, args.start, args.workdir, args.arm, args.seed, _ints(args.levels),
                     _ints(args.branch_turns), _ints(args.fanouts), args.per_level)
    result = run(cfg, args.arm, args.workdir, args.seed)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
