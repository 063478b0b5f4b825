"""Metric writers: JSONL (the source of truth, plotted by `plot_metrics`) and TensorBoard event files."""
from __future__ import annotations

import json
import math
import os

import numpy as np


class MetricWriter:
  """Appends `{"step": s, **scalars}` to workdir/metrics.jsonl and mirrors scalars to TensorBoard."""

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._f = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, scalars: dict) -> None:
    row = {"step": int(step)}
    for k, v in scalars.items():
      row[k] = float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v).tolist()
    self._f.write(json.dumps(row) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, float) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def close(self) -> None:
    self._f.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def moving_average(values, window: int) -> list[float]:
  """Trailing mean over the last `window` values (fewer at the start)."""
  out, total = [], 0.0
  for i, v in enumerate(values):
    total += v
    if i >= window:
      total -= values[i - window]
    out.append(total / min(i + 1, window))
  return out


def measured_points(rows: list[dict], key: str) -> list[tuple[int, float]]:
  """(step, value) of `key` where it was measured: NaN marks a metric not measured at a step (the RL step's
  `logprob_gap_no_replay` between its scheduled steps), and a line through NaNs would draw nothing."""
  return [(r["step"], r[key]) for r in rows
          if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def part_means(rows: list[dict], keys, parts: int = 4) -> dict[str, list[float]]:
  """Per key, its mean over each of `parts` consecutive equal shares of the rows that measured it (the last share
  takes the remainder): how a per-step metric moved over training. Keys measured in fewer than `parts` rows are
  left out."""
  out = {}
  for key in keys:
    vals = [v for _, v in measured_points(rows, key)]
    if len(vals) < parts:
      continue
    size = len(vals) // parts
    out[key] = [float(np.mean(vals[i * size:(i + 1) * size if i < parts - 1 else len(vals)])) for i in range(parts)]
  return out


def plot_lines(path: str, out_png: str, keys: tuple[str, ...], *, title: str = "", ylabel: str = "",
               smooth: int = 10) -> None:
  """Each key of the JSONL file against step on one panel, as its trailing `smooth`-step mean."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = read_metrics(path)
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key in keys:
    pts = measured_points(rows, key)
    if pts:
      steps, vals = zip(*pts)
      ax.plot(steps, moving_average(vals, max(smooth, 1)), label=key)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend(loc="best", fontsize="small")
  if title:
    ax.set_title(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)


def plot_metrics(path: str, out_png: str, keys: tuple[str, ...], *, title: str = "", smooth: int = 0) -> None:
  """Plots each key of the JSONL file against step (one panel per key) into a PNG; with `smooth` > 1 the raw
  values are drawn faintly under their trailing `smooth`-step mean (noisy per-step RL metrics)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = read_metrics(path)
  fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
  for ax, key in zip(axes[0], keys):
    pts = measured_points(rows, key)
    if pts and smooth > 1 and len(pts) > smooth:
      steps, vals = zip(*pts)
      ax.plot(steps, vals, alpha=0.3, label="per step")
      ax.plot(steps, moving_average(vals, smooth), label=f"mean of last {smooth}")
      ax.legend(loc="best", fontsize="small")
    elif pts:
      ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None)
    ax.set_xlabel("step")
    ax.set_title(key)
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)


def penalty_terms(rows: list[dict]) -> list[str]:
  """An RL run's reward penalty terms (`reward/<term>` but the task's 0/1) that were nonzero at some step."""
  keys = sorted({k for row in rows for k in row if k.startswith("reward/") and k != "reward/task"})
  return [k for k in keys if any(v for _, v in measured_points(rows, k))]


def plot_rewards(workdir: str) -> None:
  """An RL run's plots of workdir/metrics.jsonl: workdir/reward.png (reward and pass rate per step, and the pass
  rate per level of a procedural mix) and workdir/reward_terms.png (each penalty term per step, its 10-step mean)."""
  path = os.path.join(workdir, "metrics.jsonl")
  try:
    rows = read_metrics(path)
    levels = sorted({k for row in rows for k in row if k.startswith("pass/level_")})
    plot_metrics(path, os.path.join(workdir, "reward.png"), ("reward", "pass_rate", *levels),
                 title="RL reward and pass rate per step", smooth=10)
    terms = penalty_terms(rows)
    if terms:
      plot_lines(path, os.path.join(workdir, "reward_terms.png"), tuple(terms),
                 title="reward terms per step (10-step mean)", ylabel="mean over the step's episodes")
  except Exception as e:  # noqa: BLE001 - a missing matplotlib must not fail a finished run
    print(f"(no reward plot: {e})")
