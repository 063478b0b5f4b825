"""Held-out evaluation throughput by chunk size: how many tasks the evaluator steps together (issue 48).

  PYTHONPATH=. python benchmarks/eval_batching.py [--tasks=256 --chunks=64,256 --rounds=2]

`make run` evaluates each policy on 1,500 held-out tasks (500 per level) in chunks of `chunk_tasks` tasks, each
chunk's episodes stepped together (one batched `generate` per step) until its longest episode ends, with the RL
experiment's evaluation engine (64-row buckets, `rl/experiment._engine`). A level-1 episode takes ~3 steps and a
level-3 one ~11, so a chunk of 64 runs its last steps with a few level-3 episodes in a 64-row call. A larger chunk
keeps the engine's calls full: the engine splits its rows into calls of `max_batch` = 64, and as episodes end the
rest pack into fewer calls.

The episodes are replayed from the scripted oracle's recorded turn structure on the recipe's held-out level 1-3
mix (`decode_prefix.record_structures` / `replay`: each turn asks for exactly the recorded turn's length, T = 1, and
continues from the engine's own output), with an `rl_colab`-shaped model of random weights, prefix reuse on. Chunk
sizes alternate over rounds after a warm-up round; per size the median seconds inside `generate` for the whole set.
The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable

import jax

from benchmarks import decode_prefix
from composer_jax import configs, model
from composer_jax.rl import setup
from composer_jax.rl.config import RunConfig
from composer_jax.rl.publishers import engine_config
from composer_jax.sampling.engine import JaxEngine
from composer_jax.train import tokenizer as tokenizer_lib
from experiments.configs import rl as rl_configs
from rollout.tasks import registry
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import make_factory


def recorded_mix(tasks: int, backend: str, seed: int) -> tuple[list, Callable[..., decode_prefix.Timed]]:
  """The oracle's turn structures on the first `tasks` held-out tasks of the recipe's level 1-3 mix, and a maker of
  timed engines of random weights as `rl/experiment._engine` builds the evaluation's (64-row calls), its keyword
  arguments overriding fields of their `EngineConfig`."""
  run_cfg = configs.from_dict(RunConfig, rl_configs.get_config("recipe_best").to_dict(), workdir="/tmp/unused")
  factory = make_factory(backend)
  try:
    envs = EnvironmentCache(factory)
    spec = registry.SetSpec(kind="procedural", n=tasks, seed=seed + 7, split="heldout", levels=(1, 2, 3))
    loaded = registry.load_tasks(spec, envs, log=lambda s: None)
    tok = setup.fit_tokenizer_to_source(spec, envs, run_cfg.harness.system_prompt,
                                        tokenizer_lib.TokenizerConfig(vocab_size=512), 200, seed + 1)
    structures = decode_prefix.record_structures(loaded, tok, envs, run_cfg.harness)
  finally:
    factory.close()
  mcfg = dataclasses.replace(run_cfg.model, vocab_size=tokenizer_lib.padded_vocab_size(tok))
  params = model.init(jax.random.key(seed), mcfg)

  def make_engine(**overrides) -> decode_prefix.Timed:
    ecfg = dataclasses.replace(engine_config(dataclasses.replace(run_cfg, seed=seed)), min_batch_bucket=64,
                               max_batch=64, **overrides)   # rl/experiment._engine's evaluation engine
    return decode_prefix.Timed(JaxEngine(params, mcfg, ecfg))
  return structures, make_engine


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tasks", type=int, default=256, help="held-out tasks of the level 1-3 mix")
  ap.add_argument("--chunks", default="64,256", help="chunk sizes to compare (the first is the baseline)")
  ap.add_argument("--rounds", type=int, default=2, help="timed rounds per chunk size, after one warm-up round")
  ap.add_argument("--backend", default="local", help="workspaces of the recording: local or sandbox")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  chunks = [int(c) for c in args.chunks.split(",")]

  structures, make_engine = recorded_mix(args.tasks, args.backend, args.seed)
  engine = make_engine()
  seconds = {c: [] for c in chunks}
  calls = {}
  for rnd in range(args.rounds + 1):
    for chunk in (chunks if rnd % 2 == 0 else chunks[::-1]):
      engine.reset()
      t0 = time.perf_counter()
      for c0 in range(0, len(structures), chunk):
        decode_prefix.replay(engine, structures[c0:c0 + chunk], args.seed + c0)
      wall = time.perf_counter() - t0
      if rnd:
        seconds[chunk].append(engine.seconds)
      calls[chunk] = engine.calls
      print(f"round {rnd} chunk {chunk:4d}: {engine.seconds:.1f} s in generate ({wall:.1f} s wall), {engine.calls} "
            f"calls, {engine.generated} tokens; load {os.getloadavg()[0]:.1f}", flush=True)
  med = {c: statistics.median(v) for c, v in seconds.items()}
  base = chunks[0]
  print(json.dumps({"generate_s": {str(c): round(v, 2) for c, v in med.items()},
                    "speedup_vs_chunk": {str(c): round(med[base] / v, 3) for c, v in med.items()},
                    "baseline_chunk": base, "generate_calls": {str(c): n for c, n in calls.items()},
                    "tasks": len(structures), "steps_per_task": round(
                        sum(sum(isinstance(x, int) for x in seg) for ep in structures for seg in ep) / len(structures),
                        2), "rounds": args.rounds, "load_average": [round(x, 2) for x in os.getloadavg()],
                    "backend": jax.default_backend()}))


if __name__ == "__main__":
  main()
