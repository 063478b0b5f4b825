"""Decode time of the held-out evaluation's batched calls with decoding shrunk to the live rows vs the whole batch
stepped to its longest row (issue 48).

  PYTHONPATH=. python benchmarks/decode_shrink.py [--tasks=256 --rounds=5 --shrink_rows=8,2]

A batched `generate` call decodes until its longest row ends; on the held-out level 1-3 mix most rows of a call end
long before its longest one, and a decode step's time grows with the rows it runs. With
`EngineConfig.shrink_rows` = n (`shrink<n>`, one arm per value of `--shrink_rows`) the engine stops each time at
most half the rows are live and goes on with those alone, in a batch of the next power of two >= n; `whole`
(`shrink_rows=0`) steps every row to the end.

The evaluation's episodes are replayed as `benchmarks/eval_batching.py` replays them (the oracle's recorded turn
structure on the first `--tasks` held-out tasks, each turn asking for exactly the recorded turn's length at T = 1,
chunks of 256 tasks, the evaluation engine's 64-row calls with prefix reuse, random `rl_colab`-shaped weights).
The engines replay the same episodes in turn, the order reversed every round, over `--rounds` rounds after a
warm-up round (compiles, counted per engine: `compiles`, `compile_s`); per engine the median seconds inside
`generate` and inside its decode programs. A shrunk row is computed in a batch
of another size, so its floats may round differently (~1e-6 in a logprob): the engines draw the same tokens except
where a draw falls that close to a boundary, and an episode that drew one other token goes on differently
(`episodes_identical`: the share of episodes whose every token is the same). The last line printed is one JSON
object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax

from benchmarks import decode_prefix
from benchmarks.eval_batching import recorded_mix

CHUNK = 256   # the evaluation's chunk of tasks stepped together (rl/evaluate.success_rate)


class DecodeTimed(decode_prefix.Timed):
  """`decode_prefix.Timed` that also sums the seconds of the engine's decode programs (each `max_batch`-row call
  of a `generate`)."""

  def __init__(self, engine):
    super().__init__(engine)
    chunk = engine._generate_chunk

    def timed_chunk(requests):
      out = chunk(requests)
      self.decode_seconds += engine.last_stats["decode_s"]
      return out
    engine._generate_chunk = timed_chunk

  def reset(self):
    super().reset()
    self.decode_seconds = 0.0


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tasks", type=int, default=256, help="held-out tasks of the level 1-3 mix")
  ap.add_argument("--rounds", type=int, default=5, help="timed rounds per engine, after one warm-up round")
  ap.add_argument("--shrink_rows", default="8,2", help="EngineConfig.shrink_rows of each shrinking engine")
  ap.add_argument("--backend", default="local", help="workspaces of the recording: local or sandbox")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  structures, make_engine = recorded_mix(args.tasks, args.backend, args.seed)
  floors = [int(n) for n in args.shrink_rows.split(",")]
  engines = {**{f"shrink{n}": DecodeTimed(make_engine(shrink_rows=n).engine) for n in floors},
             "whole": DecodeTimed(make_engine(shrink_rows=0).engine)}
  gen, dec, tokens = {n: [] for n in engines}, {n: [] for n in engines}, {}
  for rnd in range(args.rounds + 1):
    for name in (list(engines) if rnd % 2 == 0 else list(engines)[::-1]):
      engine = engines[name]
      engine.reset()
      t0 = time.perf_counter()
      tokens[name] = [t for c0 in range(0, len(structures), CHUNK)
                      for t in decode_prefix.replay(engine, structures[c0:c0 + CHUNK], args.seed + c0)]
      wall = time.perf_counter() - t0
      if rnd:
        gen[name].append(engine.seconds)
        dec[name].append(engine.decode_seconds)
      print(f"round {rnd} {name:6s}: {engine.seconds:.1f} s in generate, {engine.decode_seconds:.1f} s decoding "
            f"({wall:.1f} s wall), {engine.calls} calls, {engine.generated} tokens; load {os.getloadavg()[0]:.1f}",
            flush=True)
  med = {n: statistics.median(v) for n, v in gen.items()}
  med_dec = {n: statistics.median(v) for n, v in dec.items()}
  print(json.dumps({"generate_s": {n: round(v, 2) for n, v in med.items()},
                    "decode_s": {n: round(v, 2) for n, v in med_dec.items()},
                    "speedup_generate": {n: round(med["whole"] / med[n], 3) for n in engines if n != "whole"},
                    "speedup_decode": {n: round(med_dec["whole"] / med_dec[n], 3) for n in engines if n != "whole"},
                    "episodes_identical": {n: sum(a == b for a, b in zip(tokens[n], tokens["whole"], strict=True))
                                           / len(structures) for n in engines if n != "whole"},
                    "compiles": {n: e.engine.compiles for n, e in engines.items()},
                    "compile_s": {n: round(e.engine.compile_s, 1) for n, e in engines.items()},
                    "tasks": len(structures), "rounds": args.rounds,
                    "load_average": [round(x, 2) for x in os.getloadavg()], "backend": jax.default_backend()}))


if __name__ == "__main__":
  main()
