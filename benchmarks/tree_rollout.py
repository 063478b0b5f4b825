"""Tree rollouts against flat groups at equal G (issue 50): what a group costs per leaf.

  PYTHONPATH=. python benchmarks/tree_rollout.py --workdir=runs/rl --levels=2,3 --tasks=8
  PYTHONPATH=. python benchmarks/tree_rollout.py --workdir=runs/rl --branch_turns=0,2 --fanouts=2,4

From one policy (the run's SFT start, `<workdir>/sft`, or `--params=<dir>` holding exported params) and the run's
harness, engine and sandbox settings, each training task of each level is rolled out as a flat group (G episodes
from the prompt) and as a tree of the same G leaves (`rollout.tree_harness`), the two arms alternating which goes
first, with the engine's prefix cache emptied before every group (no arm reuses the other's prefixes). Per leaf:
  * generated tokens: what the engine decoded (a shared opening counts once);
  * unrolled tokens: the generated tokens of every leaf's whole stream (multiplicity included), as if each leaf had
    been sampled on its own. Each leaf is marginally an episode of the policy, so per leaf this estimates a flat
    group's generated tokens from the same group: `unrolled_over_generated` is the tree's saving measured within
    each group (paired), without the episode-to-episode spread that the flat arm's comparison carries;
  * prefilled tokens: prompt tokens the engine ran (those its prefix cache did not hold);
  * sandbox-seconds: wall-clock inside workspace calls (tool calls, forks, snapshots, grading, closing);
  * rollout seconds: the group's wall-clock, and engine seconds, the part spent in `generate`;
  * solved: the leaves' success rate (the same policy in both arms, so it should agree within noise);
  * distinct leaves: the share of leaves that are episodes of their own (a tree episode that ends before a branch
    point stands for all the leaves below it, `multiplicity`: fewer distinct samples for the same G);
  * trainer tokens: what the trainer's batch stores of the group (`rl.batch.segment_lengths`), with each shared
    prefix once (`BatchConfig.share_prefix`) and, as `trainer_tokens_dup`, with it repeated in each branch's row.
One flat and one tree group on another task run first, untimed, so compiling is not in any figure.
Environment snapshots are built before timing. The last line printed is one JSON object with these per arm and
level and the flat/tree ratios (`flat_over_tree`: flat's figures per leaf over the tree's); the load average
is printed beside it, since timings on a shared machine mean something only as same-run ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from composer_jax.rl import batch as rl_batch
from composer_jax.rl import publishers, setup
from composer_jax.rl import workdir as workdir_lib
from composer_jax.sampling.engine import JaxEngine
from composer_jax.train import stages
from rollout import harness, tree_harness
from rollout.workspace import Workspace, WorkspaceFactory


class Clock:
  """Seconds spent inside timed calls."""

  def __init__(self):
    self.seconds = 0.0

  def timed(self, fn, *args, **kwargs):
    t = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      self.seconds += time.perf_counter() - t


class TimedWorkspace(Workspace):
  """A workspace whose every call is added to a clock."""

  def __init__(self, inner: Workspace, clock: Clock):
    self.inner, self.clock = inner, clock

  def run(self, command, timeout_s=30.0, output_limit=1 << 16):
    return self.clock.timed(self.inner.run, command, timeout_s, output_limit)

  def read_file(self, path):
    return self.clock.timed(self.inner.read_file, path)

  def write_file(self, path, text):
    return self.clock.timed(self.inner.write_file, path, text)

  def list_dir(self, path="."):
    return self.clock.timed(self.inner.list_dir, path)

  def exists(self, path):
    return self.clock.timed(self.inner.exists, path)

  def close(self):
    return self.clock.timed(self.inner.close)


class TimedFactory(WorkspaceFactory):
  """A factory whose forks, snapshots and workspaces are timed on one clock (environment builds are not: they are
  cached before timing starts)."""

  def __init__(self, inner: WorkspaceFactory, clock: Clock):
    self.inner, self.clock = inner, clock

  def snapshot_from_dir(self, directory):
    return self.inner.snapshot_from_dir(directory)

  def fork(self, snapshot):
    return TimedWorkspace(self.clock.timed(self.inner.fork, snapshot), self.clock)

  def snapshot(self, workspace):
    inner = workspace.inner if isinstance(workspace, TimedWorkspace) else workspace
    return self.clock.timed(self.inner.snapshot, inner)

  def delete_snapshot(self, snapshot):
    return self.clock.timed(self.inner.delete_snapshot, snapshot)

  def close(self):
    self.inner.close()


class CountingEngine:
  """The engine, counting generated and prefilled tokens and the seconds spent generating."""

  def __init__(self, engine: JaxEngine):
    self.engine, self.clock = engine, Clock()
    self.generated = self.prefilled = 0

  def generate(self, requests):
    results = self.clock.timed(self.engine.generate, requests)
    self.generated += sum(len(r.output_ids) for r in results)
    stats = self.engine.last_stats   # of its last chunk; one chunk per call at max_batch >= the group's rows
    self.prefilled += stats.get("prompt_tokens", 0) - stats.get("prefix_reused_tokens", 0)
    return results


def branch_turn(traj) -> int | None:
  """Action turns a tree leaf had before its second node starts (where its first branch point below the prompt
  is), None for a flat leaf or a leaf that ended before it."""
  starts = (traj.tree or {}).get("starts", [])
  if len(starts) < 2:
    return None
  seg, off = starts[1]
  return sum(t["kind"] == "act" and (s < seg or t["start"] < off)
             for s, segment in enumerate(traj.segments[:seg + 1]) for t in segment.turns)


def trainer_tokens(trajs, length: int, share_prefix: bool) -> int:
  """Tokens the trainer's batch stores of a group (its rows, or packed sequences, laid end to end)."""
  cfg = rl_batch.BatchConfig(rows=1, length=length, n_moe_layers=0, top_k=1, share_prefix=share_prefix)
  return sum(rl_batch.segment_lengths([t.to_dict() for t in trajs], cfg))


def rollout_cost(engine: CountingEngine, sandbox: Clock, group, task, length: int) -> dict:
  """Runs `group(task)` (one group's rollout) and returns what it cost and its leaves' success (`length`: the
  trainer's row length)."""
  engine.engine.prefix_cache.clear()
  g0, p0, e0, s0 = engine.generated, engine.prefilled, engine.clock.seconds, sandbox.seconds
  t = time.perf_counter()
  trajs = group(task)
  return {"wall_s": time.perf_counter() - t, "engine_s": engine.clock.seconds - e0,
          "sandbox_s": sandbox.seconds - s0, "generated": engine.generated - g0, "prefilled": engine.prefilled - p0,
          "leaves": sum((t.tree or {}).get("multiplicity", 1) for t in trajs), "episodes": len(trajs),
          "unrolled": sum((t.tree or {}).get("multiplicity", 1) * t.n_generated for t in trajs),
          "trainer_tokens": trainer_tokens(trajs, length, True),
          "trainer_tokens_dup": trainer_tokens(trajs, length, False),
          "solved": float(np.mean([t.metrics["solved"] for t in trajs])),
          "branch_turns": [b for b in map(branch_turn, trajs) if b is not None]}


def per_leaf(rows: list[dict]) -> dict:
  leaves = sum(r["leaves"] for r in rows)
  keys = ("generated", "unrolled", "prefilled", "sandbox_s", "wall_s", "engine_s", "trainer_tokens",
          "trainer_tokens_dup")
  out = {k: sum(r[k] for r in rows) / leaves for k in keys if k in rows[0]}
  if "unrolled" in out:
    out["unrolled_over_generated"] = out["unrolled"] / max(out["generated"], 1e-9)
  turns = [b for r in rows for b in r["branch_turns"]]
  out.update(groups=len(rows), leaves=leaves, distinct_leaves=sum(r["episodes"] for r in rows) / leaves,
             branch_turn=float(np.mean(turns)) if turns else None,
             solved=float(np.mean([r["solved"] for r in rows])))
  return out


ARMS = ("flat", "tree", "tree_entropy")
FIGURES = (("generated", "generated tokens / leaf"), ("unrolled", "unrolled tokens / leaf"),
           ("prefilled", "prefilled tokens / leaf"),
           ("sandbox_s", "sandbox-seconds / leaf"), ("wall_s", "rollout seconds / leaf"),
           ("trainer_tokens", "trainer tokens / leaf"))


def render(result: dict, prefix: str) -> None:
  """`prefix`.md (a table per level) and `prefix`.png (flat against tree per figure and level) from a result."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  levels = sorted(result["levels"])
  arms = [a for a in ARMS if a in result["levels"][levels[0]]]
  figures = [f for f in FIGURES if f[0] in result["levels"][levels[0]]["flat"]]   # older results lack some
  # Generated tokens per episode: a leaf that stands for several (it ended before a branch point) counts once, so
  # a tree that saves tokens by collapsing its leaves into fewer distinct samples shows it here.
  per_episode = {lv: {arm: result["levels"][lv][arm]["generated"] / result["levels"][lv][arm]["distinct_leaves"]
                      for arm in arms} for lv in levels}
  paired = "unrolled_over_generated" in result["levels"][levels[0]]["flat"]
  lines = [f"| level | arm | {' | '.join(name for _, name in figures)} | generated tokens / episode | "
           + ("unrolled / generated | " if paired else "") + "distinct leaves | mean branch turn | solved |",
           "|---|---|" + "---|" * (len(figures) + 4 + paired)]
  for lv in levels:
    row = result["levels"][lv]
    for arm in arms:
      r = row[arm]
      turn = "" if r["branch_turn"] is None else f"{r['branch_turn']:.2f}"
      lines.append(f"| {lv} | {arm} | " + " | ".join(f"{r[k]:.3g}" for k, _ in figures)
                   + f" | {per_episode[lv][arm]:.3g} | "
                   + (f"{r['unrolled_over_generated']:.2f}x | " if paired else "")
                   + f"{r['distinct_leaves']:.2f} | {turn} | {r['solved']:.3f} |")
    for arm in arms[1:]:
      q = row[f"flat_over_{arm}"]
      lines.append(f"| {lv} | flat / {arm} | " + " | ".join(
          f"{q[k]:.2f}x" + (f" (paired median {q['wall_s_paired_median']:.2f}x)" if k == "wall_s" else "")
          for k, _ in figures) + f" | {per_episode[lv]['flat'] / per_episode[lv][arm]:.2f}x | | | |"
          + (" |" if paired else ""))
  with open(prefix + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 3.2))
  x = np.arange(len(levels))
  for ax, (key, name) in zip(axes, figures, strict=True):
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
      ax.bar(x + (j - (len(arms) - 1) / 2) * width, [result["levels"][lv][arm][key] for lv in levels], width,
             label=arm)
    ax.set_xticks(x, [f"level {lv}" for lv in levels])
    ax.set_title(name, fontsize=10)
  axes[0].legend(loc="lower left", fontsize=8)
  by_entropy = (f"; tree_entropy: branch_entropy {result['branch_entropy']}, by turns "
                f"{result['entropy_branch_turns']}" if result.get("branch_entropy") else "")
  fig.suptitle(f"G = {result['G']}: flat groups vs trees (branch_turns {result['branch_turns']}, fanouts "
               f"{result['fanouts']}{by_entropy})", fontsize=10)
  fig.tight_layout()
  fig.savefig(prefix + ".png", dpi=110)


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(","))


def measure(args, cfg, tree: tree_harness.TreeConfig, tok, pool: list, envs) -> dict:
  """Every arm's groups on `args.tasks` training tasks of each level (`main`'s arguments), per leaf."""
  G = tree.size
  params = stages.load_params(args.params or os.path.join(args.workdir, "sft"), cfg.model)
  engine = CountingEngine(JaxEngine(params, cfg.model, publishers.engine_config(cfg)))
  sandbox = Clock()
  envs.factory = TimedFactory(envs.factory, sandbox)
  hcfg = cfg.harness
  runs = {"flat": lambda task: harness.run_episodes(engine, tok, [task] * G, envs, hcfg),
          "tree": lambda task: tree_harness.rollout_tree(engine, tok, task, envs, hcfg, tree)}
  if args.branch_entropy:
    by_entropy = dataclasses.replace(tree, branch_entropy=args.branch_entropy,
                                     branch_turns=_ints(args.entropy_branch_turns or args.branch_turns))
    runs["tree_entropy"] = lambda task: tree_harness.rollout_tree(engine, tok, task, envs, hcfg, by_entropy)
  result = {"workdir": args.workdir, "G": G, "branch_turns": list(tree.branch_turns), "fanouts": list(tree.fanouts),
            "branch_entropy": args.branch_entropy or None,
            "entropy_branch_turns": list(by_entropy.branch_turns) if args.branch_entropy else None, "levels": {}}
  for level in map(int, args.levels.split(",")):
    *tasks, warm = setup.of_levels(pool, (level,))[:args.tasks + 1]
    for task in tasks + [warm]:
      envs.snapshot(task.environment)   # built (and cached) before timing
    arms = {arm: [] for arm in runs}
    for group in runs.values():   # compiles the engine's programs outside the timed groups
      rollout_cost(engine, sandbox, group, warm, hcfg.context_budget)
    for i, task in enumerate(tasks):
      order = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]   # each arm goes first as often
      for arm in order:
        arms[arm].append(rollout_cost(engine, sandbox, runs[arm], task, hcfg.context_budget))
      print(f"level {level} task {i}: " + ", ".join(f"{a} {r[-1]['generated'] / G:.0f} tok/leaf "
                                                    f"{r[-1]['wall_s']:.1f}s" for a, r in arms.items()), flush=True)
    row = {arm: per_leaf(rows) for arm, rows in arms.items()}
    for arm in list(runs)[1:]:
      q = {k: row["flat"][k] / max(row[arm][k], 1e-9) for k, _ in FIGURES}
      q["trainer_tokens_dup"] = row["flat"]["trainer_tokens_dup"] / max(row[arm]["trainer_tokens_dup"], 1e-9)
      # Per task (paired), the median of flat/tree wall-clock: robust to a load spike in one group.
      q["wall_s_paired_median"] = float(np.median([f["wall_s"] / t["wall_s"]
                                                    for f, t in zip(arms["flat"], arms[arm], strict=True)]))
      row[f"flat_over_{arm}"] = q
    result["levels"][str(level)] = row
  return result


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", default="", help="an RL run's workdir (its run config and tokenizer)")
  ap.add_argument("--params", default="", help="exported params to roll out with (default: <workdir>/sft)")
  ap.add_argument("--levels", default="2,3")
  ap.add_argument("--tasks", type=int, default=8, help="training tasks per level (one group per arm each; one more "
                  "warms up)")
  ap.add_argument("--branch_turns", default="0,2")
  ap.add_argument("--fanouts", default="2,4")
  ap.add_argument("--branch_entropy", type=float, default=0.0, help="> 0: a third arm, a tree of the same fanouts "
                  "branching where a greedy probe meets a token of this entropy (nats), by --entropy_branch_turns")
  ap.add_argument("--entropy_branch_turns", default="", help="that arm's deadlines (default: --branch_turns)")
  ap.add_argument("--out", default="", help="also write the JSON here, and its table and plot beside it (.md, .png)")
  ap.add_argument("--render", default="", help="only render the table and plot of this JSON (written by --out)")
  args = ap.parse_args(argv)
  if args.render:
    with open(args.render) as f:
      result = json.load(f)
    render(result, os.path.splitext(args.render)[0])
    return result
  if not args.workdir:
    ap.error("--workdir is required (an RL run's workdir), unless --render")
  cfg = workdir_lib.load_run_config(args.workdir)
  tree = tree_harness.TreeConfig(_ints(args.branch_turns), _ints(args.fanouts))
  with setup.open_run(cfg) as run:
    result = measure(args, cfg, tree, run.tokenizer, run.pool, run.envs)
  result["load_avg"] = list(os.getloadavg())
  print(f"load average {os.getloadavg()}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
    render(result, os.path.splitext(args.out)[0])
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  sys.exit(main() and 0)
