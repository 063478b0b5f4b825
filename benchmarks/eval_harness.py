"""Held-out evaluation wall-clock by the harness's concurrency: episodes graded as they end and a step's turns run at
once, against one after another (issue 48).

  PYTHONPATH=. python benchmarks/eval_harness.py --start=runs/mtp_rl/start [--tasks=256 --rounds=5 --temperature=1]

The evaluation of `make run` (`rl/experiment.evaluate_at_temperatures`: the evaluation engine, chunks of 256 tasks,
the recipe's harness in bubblewrap sandboxes) of a trained policy, `benchmarks/mtp_rl.py --arm=start`'s SFT start
(the default recipe's warm start, which also serves the tree and MTP measurements), on the first `--tasks` held-out
tasks of the recipe's level 1-3 mix. Each chunk's episodes step together, one batched `generate` a step; after it
each episode's turn runs its tool calls, and an episode that ended is graded (its hidden tests), each a sandboxed
process that is mostly start-up and waiting. Arms (`rollout.harness.HarnessConfig`):

- `now`: the defaults: each episode graded as soon as it ends, in `grade_workers` threads while the engine generates
  for the rest (`grade_early`), and a step's turns in `tool_workers` threads at once;
- `serial_turns`: graded as they end, turns one after another (`tool_workers=1`);
- `before`: turns one after another, every grade once the chunk's longest episode ends (`grade_early=False`) — the
  harness before either (except that a grade no longer removes its report files: the workspace is closed next).

The arms take turns, the order reversed every round, over `--rounds` rounds after one warm-up round (compiles), each
evaluation into a fresh directory and from an empty prefix cache; per arm the median wall-clock and the seconds
inside `generate`. Every arm must give the same per-task results (`same_results`: solved, tokens, turns, tool calls).
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

from benchmarks import decode_prefix, rl_from_start
from composer_jax.rl import evaluate, experiment, warmstart
from composer_jax.rl import workdir as workdir_lib

ARMS = {"now": {}, "serial_turns": {"tool_workers": 1}, "before": {"tool_workers": 1, "grade_early": False}}
KEYS = ("solved", "output_tokens", "turns", "tool_calls", "stop_reason")


def evaluate_once(engine: decode_prefix.Timed, run, hcfg, temperature: float, chunk: int) -> tuple[float, float, list]:
  """(wall-clock, seconds in generate, per-task results) of one evaluation into a fresh directory, from an empty
  prefix cache (the arms sample the same episodes: one must not reuse another's)."""
  engine.reset()
  with tempfile.TemporaryDirectory(prefix="eval_harness_") as out:
    t0 = time.perf_counter()
    evaluate.success_rate(engine, run.tokenizer, run.heldout, run.envs, hcfg, temperature, out, chunk=chunk)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "results.jsonl")) as f:
      results = [[r["task_id"], *(r["samples"][0][k] for k in KEYS)] for r in map(json.loads, f)]
  return wall, engine.seconds, sorted(results)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--start", default="runs/mtp_rl/start", help="benchmarks/mtp_rl.py --arm=start's workdir")
  ap.add_argument("--tasks", type=int, default=256, help="held-out tasks (the recipe's level 1-3 mix)")
  ap.add_argument("--rounds", type=int, default=5, help="timed rounds per arm, after one warm-up round")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--chunk", type=int, default=256, help="tasks stepped together (the evaluation's default)")
  args = ap.parse_args()
  if rl_from_start.done(args.start) is None:
    raise SystemExit(f"{args.start} holds no finished start: run `python benchmarks/mtp_rl.py --arm=start "
                     f"--workdir={os.path.dirname(args.start.rstrip('/')) or '.'}` first")
  load0 = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix="eval_harness_run_") as workdir:
    cfg = rl_from_start.from_start("default", args.start, workdir, 0, **{"eval.tasks": args.tasks})
    with workdir_lib.claim(cfg, ()) as run:
      engine = decode_prefix.Timed(experiment._engine(cfg, warmstart.warm_start(cfg.sft_plan, run, lambda s: None)))
      walls, gens, results = {a: [] for a in ARMS}, {a: [] for a in ARMS}, {}
      for rnd in range(args.rounds + 1):
        for arm in (list(ARMS) if rnd % 2 == 0 else list(ARMS)[::-1]):
          hcfg = dataclasses.replace(cfg.harness, **ARMS[arm])
          wall, gen, results[arm] = evaluate_once(engine, run, hcfg, args.temperature, args.chunk)
          if rnd:
            walls[arm].append(wall)
            gens[arm].append(gen)
          print(f"round {rnd} {arm:12s}: {wall:.1f} s ({gen:.1f} s in generate); load {os.getloadavg()[0]:.1f}",
                flush=True)
  med = {a: statistics.median(v) for a, v in walls.items()}
  print(json.dumps({
      "wall_s": {a: round(v, 2) for a, v in med.items()},
      "generate_s": {a: round(statistics.median(v), 2) for a, v in gens.items()},
      "speedup_vs_before": {a: round(med["before"] / med[a], 3) for a in ARMS if a != "before"},
      "same_results": all(results[a] == results["before"] for a in ARMS),
      "solved": sum(r[1] for r in results["now"]) / len(results["now"]),
      "tasks": args.tasks, "chunk": args.chunk, "temperature": args.temperature, "rounds": args.rounds,
      "grade_workers": cfg.harness.grade_workers, "tool_workers": cfg.harness.tool_workers,
      "load_average_start": [round(x, 2) for x in load0],
      "load_average": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
  main()
