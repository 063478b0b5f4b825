"""Tables and plots of `rl_main` runs, generated from their `results.json` (numbers are written once: here).

A run's results.json (`rl.experiment.run_experiment`) holds, per policy (`POLICIES`) and temperature ("T0" greedy,
"T1"), the held-out solve rate with its Wilson 95% CI, the mean generated tokens per solved task and, for a
procedural mix, the same per level. `render` turns a sweep (labelled runs, e.g. the rows of `get_sweep("recipe")`)
into `<name>.md` with its plots beside it, and the README's short table between two marker lines:

  python experiments/report_main.py --name=recipe --runs=seed0=runs/recipe_s0,seed1=runs/recipe_s1,... \
      --out=experiments/results --readme=README.md
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

POLICIES = {"sft": "SFT start", "rl": "RL", "sft_control": "SFT control (same wall-clock)",
            "rl_start_summaries": "RL with the start's summaries",
            "rl_drop_oldest": "RL without summaries (oldest turns dropped)"}
TEMPERATURES = {"T0": "greedy", "T1": "T=1"}


def load(path: str) -> dict:
  """A run's results: `path` is its results.json or the workdir holding it."""
  if os.path.isdir(path):
    path = os.path.join(path, "results.json")
  with open(path) as f:
    return json.load(f)


def cell(fig: dict | None) -> str:
  """'50.0% [45.6, 54.4]' (solve rate, Wilson 95% CI); '—' where the figure was not measured."""
  if not fig:
    return "—"
  return f"{100 * fig['success']:.1f}% [{100 * fig['ci_low']:.1f}, {100 * fig['ci_high']:.1f}]"


def levels_of(result: dict, policies: Sequence[str] = tuple(POLICIES)) -> list[str]:
  """The procedural levels a run evaluated `policies` on ([] for a source without levels)."""
  found = {lv for p in policies if p in result for t in result[p].values() for lv in t.get("levels", {})}
  return sorted(found, key=int)


def _levels_of_runs(runs: Sequence[tuple[str, dict]]) -> list[str | None]:
  """The levels any of the runs was evaluated on, or [None] (one overall column) for sources without levels."""
  return sorted({lv for _, r in runs for lv in levels_of(r)}, key=int) or [None]


def _prefix(level: str | None) -> str:
  return f"L{level} " if level else ""


def _tick(level: str | None) -> str:
  return "all" if level in (None, "all") else f"level {level}"


def _fig(result: dict, policy: str, temp: str, level: str | None) -> dict | None:
  fig = result.get(policy, {}).get(temp)
  if fig is None or level is None:
    return fig
  return fig.get("levels", {}).get(level)


def policy_table(result: dict) -> str:
  """One run: a row per evaluated policy, a column per (level, temperature)."""
  levels = levels_of(result) or [None]
  cols = [(lv, t) for lv in levels for t in TEMPERATURES]
  head = [f"{_prefix(lv)}{TEMPERATURES[t]}" for lv, t in cols]
  n = {_fig(result, "sft", "T1", lv)["n"] for lv in levels if _fig(result, "sft", "T1", lv)}
  lines = [f"| policy (n = {', '.join(map(str, sorted(n)))} per level) | " + " | ".join(head) + " |",
           "|---" * (len(cols) + 1) + "|"]
  for p, name in POLICIES.items():
    if p in result:
      lines.append(f"| {name} | " + " | ".join(cell(_fig(result, p, t, lv)) for lv, t in cols) + " |")
  return "\n".join(lines)


def gains(result: dict, temp: str = "T1") -> dict[str, dict[str, float]]:
  """Per level (or "all"): RL minus its start and minus the control, in points."""
  out = {}
  for lv in levels_of(result) or [None]:
    rl, start, ctrl = (_fig(result, p, temp, lv) for p in ("rl", "sft", "sft_control"))
    if rl and start:
      out[lv or "all"] = {"over_start": 100 * (rl["success"] - start["success"]),
                          **({"over_control": 100 * (rl["success"] - ctrl["success"])} if ctrl else {})}
  return out


def sweep_table(runs: Sequence[tuple[str, dict]], policy: str = "rl", temp: str = "T1") -> str:
  """Many runs: a row per run, per level the policy's solve rate and its mean generated tokens per solved task."""
  levels = _levels_of_runs(runs)
  head = [h for lv in levels for h in (f"{_prefix(lv)}{TEMPERATURES[temp]}", f"{_prefix(lv)}tokens/solved")]
  lines = [f"| run ({POLICIES[policy]}) | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
  for label, r in runs:
    row = []
    for lv in levels:
      fig = _fig(r, policy, temp, lv)
      tps = fig.get("tokens_per_solved") if fig else None
      row += [cell(fig), "—" if tps is None else f"{tps:.0f}"]
    lines.append(f"| {label} | " + " | ".join(row) + " |")
  return "\n".join(lines)


def start_table(runs: Sequence[tuple[str, dict]]) -> str:
  """Calibration (`eval.start_only` runs, or any run's start): per run the SFT start's solve rate per level, greedy
  / T=1, with its SFT steps (a curriculum's first stage + the rest) and wall-clock; does each level reach the ~20%
  at T=1 a group of 8 needs?"""
  levels = _levels_of_runs(runs)
  head = ["SFT tasks", "SFT steps", "SFT min"] + [f"{_prefix(lv)}greedy / T=1" for lv in levels]
  lines = ["| run | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
  for label, r in runs:
    rates = ["/".join("—" if (f := _fig(r, "sft", t, lv)) is None else f"{100 * f['success']:.1f}"
                      for t in TEMPERATURES) for lv in levels]
    # A trained run's SFT phase is its rest when it resumed a copied start: its timing line says so.
    sft_s = r.get("phase_seconds", {}).get("sft_start") if r.get("start_only") else None
    steps = r.get("sft_steps", "—")
    if r.get("sft_curriculum_steps"):
      steps = f"{r['sft_curriculum_steps']} + {steps}"
    lines.append(f"| {label} | {r.get('sft_tasks', '—')} | {steps} | "
                 f"{'—' if sft_s is None else f'{sft_s / 60:.1f}'} | " + " | ".join(rates) + " |")
  return "\n".join(lines)


SUMMARY_ROWS = ("rl", "rl_start_summaries", "rl_drop_oldest")   # own summaries, the start's, none


def summary_table(runs: Sequence[tuple[str, dict]]) -> str:
  """"Do trained summaries help?": per run and level the summary rows were evaluated on, RL with its own summaries,
  with the start's and with none (oldest turns dropped), greedy / T=1, the differences in points and RL's tokens
  per solved task with its own and the start's summaries (T=1). '' when no run has a summary row."""
  lines = []
  for label, r in runs:
    if not any(p in r for p in SUMMARY_ROWS[1:]):
      continue
    for lv in levels_of(r, SUMMARY_ROWS[1:]) or [None]:
      figs = {(p, t): _fig(r, p, t, lv) for p in SUMMARY_ROWS for t in TEMPERATURES}
      rate = ["/".join("—" if figs[p, t] is None else f"{100 * figs[p, t]['success']:.1f}" for t in TEMPERATURES)
              for p in SUMMARY_ROWS]
      diff = ["/".join("—" if figs["rl", t] is None or figs[p, t] is None
                       else f"{100 * (figs['rl', t]['success'] - figs[p, t]['success']):+.1f}" for t in TEMPERATURES)
              for p in SUMMARY_ROWS[1:]]
      tps = ["—" if not figs[p, "T1"] or figs[p, "T1"].get("tokens_per_solved") is None
             else f"{figs[p, 'T1']['tokens_per_solved']:.0f}" for p in SUMMARY_ROWS[:2]]
      n = {f["n"] for f in figs.values() if f}
      lines.append(f"| {label} | {_tick(lv)} | {', '.join(map(str, sorted(n)))} | " + " | ".join(rate + diff)
                   + f" | {' / '.join(tps)} |")
  if not lines:
    return ""
  head = ("| run | level | n | own summaries | the start's summaries | no summary (oldest turns dropped) | "
          "own − start's | own − none | tokens/solved, own / start's (T=1) |")
  return "\n".join([head, "|---" * 9 + "|", *lines])


def terms_table(result: dict) -> str:
  """The reward and its terms over training (results.json `reward_terms`: means over each quarter of the RL
  steps); '' when the run did not record them."""
  terms = result.get("reward_terms") or {}
  if not terms:
    return ""
  parts = len(next(iter(terms.values())))
  lines = ["| term (mean per episode) | " + " | ".join(f"steps, part {i + 1}/{parts}" for i in range(parts)) + " |",
           "|---" * (parts + 1) + "|"]
  lines += [f"| {k} | " + " | ".join(f"{v:+.4f}" for v in vals) + " |" for k, vals in terms.items()]
  return "\n".join(lines)


def plot_levels(result: dict, out_png: str, title: str = "") -> None:
  """Solve rate per level for each policy, greedy and T=1, with the Wilson 95% CIs as error bars."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  levels = levels_of(result) or [None]
  pols = [p for p in POLICIES if p in result]
  fig, axes = plt.subplots(1, len(TEMPERATURES), figsize=(5 * len(TEMPERATURES), 4.2), squeeze=False)
  width = 0.8 / max(len(pols), 1)
  for ax, temp in zip(axes[0], TEMPERATURES, strict=True):
    for i, p in enumerate(pols):   # a bar where the policy was evaluated (the summary rows: their levels only)
      measured = [(j, f) for j, lv in enumerate(levels) if (f := _fig(result, p, temp, lv))]
      xs = [j + (i - (len(pols) - 1) / 2) * width for j, _ in measured]
      figs = [f for _, f in measured]
      ys = [100 * f["success"] for f in figs]
      err = [[y - 100 * f["ci_low"] for y, f in zip(ys, figs, strict=True)],
             [100 * f["ci_high"] - y for y, f in zip(ys, figs, strict=True)]]
      ax.bar(xs, ys, width, yerr=err, capsize=2, label=POLICIES[p])
    ax.set_xticks(range(len(levels)), [_tick(lv) for lv in levels])
    ax.set_ylabel("held-out solved (%)")
    ax.set_ylim(0, 100)
    ax.set_title(TEMPERATURES[temp])
    ax.grid(alpha=0.3, axis="y")
  # the legend below the panels: inside, it hides bars that reach the top
  ncol = max(1, min(len(pols), 3))
  legend_rows = -(-len(pols) // ncol)
  fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=ncol, fontsize="small", frameon=False)
  if title:
    fig.suptitle(title)
  fig.tight_layout(rect=(0, 0.06 * legend_rows, 1, 1))
  fig.savefig(out_png, dpi=100)
  plt.close(fig)


def plot_tokens(runs: Sequence[tuple[str, dict]], out_png: str, policy: str = "rl", temp: str = "T1") -> None:
  """Mean generated tokens per solved task, per level, one line per run (the length-penalty rows)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  levels = _levels_of_runs(runs)
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for label, r in runs:
    pts = [(j, _fig(r, policy, temp, lv)) for j, lv in enumerate(levels)]
    pts = [(j, f["tokens_per_solved"]) for j, f in pts if f and f.get("tokens_per_solved") is not None]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=label)
  ax.set_xticks(range(len(levels)), [_tick(lv) for lv in levels])
  ax.set_ylabel(f"generated tokens per solved task ({TEMPERATURES[temp]})")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)


def _timing(result: dict) -> str:
  """Each phase's wall-clock in this process (a resumed run: its rest), when RL resumed what all of its steps took,
  the control's size when it was chosen for another RL wall-clock (a control copied from a run whose RL steps
  took longer or shorter), and the phases of the earlier invocations that wrote this run's results.json."""
  phases = result.get("phase_seconds", {})
  timing = _minutes(phases)
  rl = result.get("rl_seconds")
  control = result.get("control_seconds", rl)
  sized_apart = rl is not None and abs(control - rl) > 60
  if rl is not None and abs(rl - phases.get("rl", 0.0)) > 60:
    timing += (f" ({result.get('rl_steps', '?')} RL steps took {rl / 60:.1f} min in all, the runs it resumed "
               "included" + (")" if sized_apart else "; the control got that)"))
  if sized_apart:
    timing += (f"; the control's {result.get('control_steps', '?')} SFT steps were sized for {control / 60:.1f} min "
               "of RL")
  earlier = result.get("earlier_phase_seconds", [])
  if earlier:
    timing = "; ".join(filter(None, [timing, "earlier invocations of this workdir, oldest first: " + "; ".join(
        f"[{_minutes(p) or 'not recorded'}]" for p in earlier)]))
  return timing or "not recorded"


def _minutes(phases: dict) -> str:
  return ", ".join(f"{k} {v / 60:.1f} min" for k, v in phases.items())


def render(name: str, runs: Sequence[tuple[str, str]], out_dir: str, length_runs: Sequence[str] = ()) -> str:
  """Writes `out_dir/<name>.md` (each run's policy table and plot, the sweep table) and `<name>_levels.png` /
  `<name>_tokens.png`; returns the short table (the first run's) for the README."""
  loaded = [(label, load(path)) for label, path in runs]
  if not loaded:
    raise ValueError("render needs at least one run (label=results.json or workdir)")
  os.makedirs(out_dir, exist_ok=True)
  parts = [f"# {name}: generated from the runs' results.json by `experiments/report_main.py`", ""]
  for i, (label, r) in enumerate(loaded):
    png = f"{name}_levels{'' if i == 0 else '_' + re.sub(r'[^A-Za-z0-9]+', '_', label)}.png"
    plot_levels(r, os.path.join(out_dir, png), title=f"{name}: {label}")
    timing = _timing(r)
    gain = "; ".join(f"{_tick(lv)} {g['over_start']:+.1f} over the start"
                     + (f", {g['over_control']:+.1f} over the control" if "over_control" in g else "")
                     for lv, g in gains(r).items()) or "not measured"
    said = [f"RL at T=1, in points: {gain}.", ""] if "rl" in r else ["The start only (`eval.start_only`).", ""]
    parts += [f"## {label}", "", policy_table(r), "", *said, f"Phases: {timing}.", "", f"![{label}]({png})", ""]
    if terms_table(r):
      parts += ["The reward's terms over training:", "", terms_table(r), ""]
  trained = [(label, r) for label, r in loaded if "rl" in r]
  if len(trained) > 1:
    parts += ["## All runs (RL policy, T=1)", "", sweep_table(trained), ""]
  if len(trained) < len(loaded):
    parts += ["## SFT starts (greedy / T=1, % solved)", "", start_table(loaded), ""]
  summaries = summary_table(loaded)
  if summaries:
    parts += ["## Do trained summaries help? (greedy / T=1, % solved; same context budget)", "", summaries, ""]
  chosen = [(label, r) for label, r in loaded if label in length_runs]
  if chosen:
    plot_tokens(chosen, os.path.join(out_dir, f"{name}_tokens.png"))
    parts += ["## Length penalty: tokens per solved task", "", sweep_table(chosen), "",
              f"![tokens per solved]({name}_tokens.png)", ""]
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write("\n".join(parts))
  return policy_table(loaded[0][1])


def replace_block(path: str, name: str, text: str) -> None:
  """Replaces the text between `<!-- results:<name> -->` and `<!-- /results:<name> -->` in `path` (the README)."""
  begin, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
  with open(path) as f:
    doc = f.read()
  if begin not in doc or end not in doc:
    raise ValueError(f"{path} has no '{begin}' ... '{end}' block to fill")
  head, rest = doc.split(begin, 1)
  _, tail = rest.split(end, 1)
  with open(path, "w") as f:
    f.write(f"{head}{begin}\n{text}\n{end}{tail}")
