"""Readable transcripts, the summary table and the accuracy-vs-cost (Pareto) plot across policies / checkpoints."""

from __future__ import annotations

import json
from collections.abc import Mapping


def format_transcript(traj, max_chars: int = 400) -> str:
  """A readable transcript of a `Trajectory`: one block per message, long contents cut, then the reward and its
  breakdown."""
  lines = [f"=== {traj.task_id}  stop={traj.stop_reason}  segments={len(traj.segments)}"]
  for m in traj.messages:
    body = m.get("content") or ""
    for call in m.get("tool_calls") or []:
      body += f"\n  -> {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})"
    if len(body) > max_chars:
      body = body[:max_chars] + f" ...[{len(body) - max_chars} more chars]"
    lines.append(f"[{m['role']}] {body}")
  terms = ", ".join(f"{k}={v:+.3f}" for k, v in traj.breakdown.items() if v)
  lines.append(f"reward={traj.reward:+.3f} ({terms or 'all terms 0'}) pass_fraction="
               f"{traj.metrics['pass_fraction']:.2f} tokens={traj.metrics['output_tokens']}")
  return "\n".join(lines)


COLUMNS = (("pass@1", "{:.3f}"), ("pass@1_lo", "{:.3f}"), ("pass@1_hi", "{:.3f}"), ("pass@k", "{:.3f}"),
           ("output_tokens", "{:.1f}"), ("turns", "{:.2f}"), ("tool_calls", "{:.2f}"), ("wall_s", "{:.3f}"),
           ("cost", "{:.3g}"))


def summary_table(summaries: Mapping[str, Mapping[str, float]]) -> str:
  """One row per policy. pass@k is pass@(samples per task)."""
  header = f"{'policy':<20} {'n':>4} {'k':>2} " + " ".join(f"{c:>13}" for c, _ in COLUMNS)
  rows = [header, "-" * len(header)]
  for name, s in summaries.items():
    k = int(s["samples_per_task"])
    vals = {**s, "pass@k": s.get(f"pass@{k}", s["pass@1"])}
    rows.append(f"{name:<20} {int(s['n_tasks']):>4} {k:>2} " +
                " ".join(fmt.format(vals[c]).rjust(13) for c, fmt in COLUMNS))
  return "\n".join(rows)


def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
  """Names of the (cost, accuracy) points no other point beats (<= cost and >= accuracy, one strictly)."""
  front = []
  for n, (c, a) in points.items():
    if not any((c2 <= c and a2 >= a) and (c2 < c or a2 > a) for m, (c2, a2) in points.items() if m != n):
      front.append(n)
  return sorted(front, key=lambda n: points[n][0])


def pareto_plot(summaries: Mapping[str, Mapping[str, float]], path: str, title: str = "",
                references: tuple[str, ...] = ("oracle",)) -> list[str]:
  """Writes a PNG of pass@1 (with its 95% interval) against mean inference cost per sample; returns the frontier.

  Cost is active parameters x output tokens; scripted baselines have cost 0, so the x axis is symlog (linear near
  0), or a plain axis around 0 when every policy costs 0. The frontier is drawn as a staircase that runs to the
  right edge (the accuracy reachable at each cost), so a one-point frontier is still a visible line.
  `references` (the oracle: a validity check that reads the answer) are drawn but kept off the frontier.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  points = {n: (s["cost"], s["pass@1"]) for n, s in summaries.items()}
  front = pareto_front({n: p for n, p in points.items() if n not in references})
  fig, ax = plt.subplots(figsize=(7.5, 4), dpi=100)
  seen: dict[tuple[float, float], int] = {}
  for n, s in summaries.items():
    stack = seen[points[n]] = seen.get(points[n], -1) + 1  # labels of coinciding points are stacked, not overdrawn
    ax.errorbar([s["cost"]], [s["pass@1"]], yerr=[[s["pass@1"] - s["pass@1_lo"]], [s["pass@1_hi"] - s["pass@1"]]],
                fmt="o", capsize=3, label=n)
    ax.annotate(n, (s["cost"], s["pass@1"]), textcoords="offset points", xytext=(5, 5 + 10 * stack), fontsize=8)
  max_cost = max(c for c, _ in points.values())
  if max_cost > 0:
    ax.set_xscale("symlog", linthresh=max(1.0, max_cost / 1e3))
    right = max_cost * 3
    ax.set_xlim(-0.5 * max(1.0, max_cost / 1e3), right)
  else:  # only scripted baselines: one column at 0
    right = 1.0
    ax.set_xlim(-1.0, right)
    ax.set_xticks([0.0])
  if front:
    xs = [points[n][0] for n in front] + [right]
    ys = [points[n][1] for n in front]
    ax.step(xs, ys + ys[-1:], where="post", color="k", ls="--", lw=1.2, label="Pareto front")
  ax.set_xlabel("inference cost per sample (active params x output tokens)" if max_cost > 0 else
                "inference cost per sample (all 0: scripted baselines run no model)")
  ax.set_ylabel("pass@1")
  ax.set_ylim(-0.05, 1.05)
  ax.set_title(title or "accuracy vs cost")
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return front
