"""Decode throughput on level-3 multi-turn episodes: the embedded engine with prefix reuse vs re-prefilling (issue 48).

  PYTHONPATH=. python benchmarks/decode_prefix.py [--episodes=8 --rounds=5 --backend=local]

The turn structure is recorded from `make run`'s episodes: the scripted oracle through the harness of
`rl.py:recipe_best` (context 496, turns of <= 112 tokens, summaries of <= 56, up to 4 segments and 10 turns) on
procedural level-3 held-out tasks, tokenized by a 512-token BPE fitted to level-3 training tasks. Each recorded
segment is its prompt, then model turns (generated runs) and tool results. The replay steps every episode together,
one batched `generate` per step as the harness does, with an `rl_colab`-shaped model of random weights sized as
the RL run sizes its engine (`rl/publishers.engine_config`): each turn asks for exactly the recorded turn's length
(no stop tokens, T = 1), appends the engine's own tokens and then the recorded tool result, so the next prompt
extends the previous prompt + output exactly as in a real episode; a new segment starts from its recorded prompt.

Two engines, identical but for the prefix cache, replay the same episodes (same seeds) in alternating order, each
round after one warm-up round (its compiles): `reuse` (cache on: a continuation runs only a window over its new
tail) and `reprefill` (cache off: every prompt prefilled over the whole prompt bucket, the path before the cache
existed, except that a prefill now computes logits at the last position only). Decode tokens/s = generated tokens /
seconds inside `generate`, per engine the median over rounds; the same per process CPU second
(`decode_tokens_per_cpu_s`, `speedup_vs_reprefill_cpu`: on a machine shared with other jobs the wall-time ratio
swings with the load, the CPU time each engine needs much less). The engines must generate the same tokens
(`same_tokens`). The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax

from composer_jax import configs, model
from composer_jax.rl import setup
from composer_jax.rl.config import RunConfig
from composer_jax.rl.publishers import engine_config
from composer_jax.sampling.engine import JaxEngine
from composer_jax.train import tokenizer as tokenizer_lib
from experiments.configs import rl as rl_configs
from rollout import harness
from rollout.engines.protocol import GenerateRequest, SamplingParams
from rollout.evaluation.policies import baseline
from rollout.tasks import registry
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import make_factory

ENGINES = ("reuse", "reprefill")


def record_structures(tasks, tok, envs, hcfg) -> list[list[list]]:
  """Per episode, per segment: [prompt tokens, then alternately a generated-run length (int) and tool-result
  tokens (list)], from the oracle's trajectories through the harness."""
  trajs = harness.run_episodes(baseline("oracle", tok, tasks), tok, tasks, envs, hcfg)
  episodes = []
  for t in trajs:
    segments = []
    for seg in t.segments:
      pieces, toks, gen = [[int(x) for x in seg.tokens_T[:seg.prompt_len]]], seg.tokens_T, seg.gen_mask_T
      i = seg.prompt_len
      while i < len(toks):
        j = i
        while j < len(toks) and gen[j] == gen[i]:
          j += 1
        pieces.append(j - i if gen[i] else [int(x) for x in toks[i:j]])
        i = j
      segments.append(pieces)
    episodes.append(segments)
  return episodes


def replay(engine, structures: list[list[list]], seed: int) -> list[list[int]]:
  """Steps every episode through its recorded structure with `engine`'s own turns → each episode's tokens."""
  state = [{"seg": 0, "piece": 1, "ctx": list(ep[0][0]), "all": []} for ep in structures]
  step = 0
  while True:
    live = [(i, st) for i, st in enumerate(state) if st["seg"] < len(structures[i])]
    if not live:
      return [st["all"] for st in state]
    reqs = [GenerateRequest(tuple(st["ctx"]), SamplingParams(
        temperature=1.0, max_tokens=structures[i][st["seg"]][st["piece"]], seed=seed * 100_003 + i * 1009 + step))
        for i, st in live]
    for (i, st), res in zip(live, engine.generate(reqs)):
      st["ctx"] += [int(x) for x in res.output_ids]
      seg = structures[i][st["seg"]]
      if st["piece"] + 1 < len(seg):            # the tool result after the turn
        st["ctx"] += seg[st["piece"] + 1]
      st["piece"] += 2
      if st["piece"] >= len(seg):               # segment done: the next starts from its recorded prompt
        st["all"] += st["ctx"]
        st["seg"] += 1
        if st["seg"] < len(structures[i]):
          st["ctx"], st["piece"] = list(structures[i][st["seg"]][0]), 1
    step += 1


class Timed:
  """An engine that counts the seconds (wall and process CPU) spent in `generate`, the tokens generated and the
  prompt tokens reused."""

  def __init__(self, engine: JaxEngine):
    self.engine = engine
    self.reset()

  def reset(self):
    self.seconds, self.cpu_seconds, self.generated, self.prompt, self.reused, self.calls = 0.0, 0.0, 0, 0, 0, 0
    self.engine.prefix_cache.clear()   # each round starts cold, as a fresh batch of episodes would

  def generate(self, requests):
    t0, c0 = time.perf_counter(), time.process_time()
    results = self.engine.generate(requests)
    self.seconds += time.perf_counter() - t0
    self.cpu_seconds += time.process_time() - c0
    self.generated += sum(len(r.output_ids) for r in results)
    self.prompt += self.engine.last_stats["prompt_tokens"]
    self.reused += self.engine.last_stats["prefix_reused_tokens"]
    self.calls += 1
    return results


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--episodes", type=int, default=8, help="level-3 episodes stepped together (one RL group)")
  ap.add_argument("--rounds", type=int, default=5, help="timed rounds per engine, after one warm-up round")
  ap.add_argument("--backend", default="local", help="workspaces: local or sandbox")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  run_cfg = configs.from_dict(RunConfig, rl_configs.get_config("recipe_best").to_dict(), workdir="/tmp/unused")
  hcfg = run_cfg.harness
  factory = make_factory(args.backend)
  try:
    envs = EnvironmentCache(factory)
    spec = registry.SetSpec(kind="procedural", n=args.episodes, seed=args.seed + 7, split="heldout", levels=(3,))
    tasks = registry.load_tasks(spec, envs, log=lambda s: None)
    tok = setup.fit_tokenizer_to_source(spec, envs, hcfg.system_prompt,
                                            tokenizer_lib.TokenizerConfig(vocab_size=512), 200, args.seed + 1)
    mcfg = dataclasses.replace(run_cfg.model, vocab_size=tokenizer_lib.padded_vocab_size(tok))
    params = model.init(jax.random.key(args.seed), mcfg)
    base = engine_config(dataclasses.replace(run_cfg, seed=args.seed))
    variants = {"reuse": base, "reprefill": dataclasses.replace(base, prefix_cache_bytes=0)}
    engines = {k: Timed(JaxEngine(params, mcfg, e)) for k, e in variants.items()}
    structures = record_structures(tasks, tok, envs, hcfg)
    rates, cpu_rates = {k: [] for k in ENGINES}, {k: [] for k in ENGINES}
    outputs, same = {}, True
    for rnd in range(args.rounds + 1):
      order = ENGINES if rnd % 2 == 0 else ENGINES[::-1]
      for name in order:
        eng = engines[name]
        eng.reset()
        streams = replay(eng, structures, args.seed)
        same &= outputs.setdefault(rnd, streams) == streams
        if rnd:   # round 0 compiles
          rates[name].append(eng.generated / eng.seconds)
          cpu_rates[name].append(eng.generated / eng.cpu_seconds)
        print(f"round {rnd} {name:12s} {eng.generated} tokens in {eng.seconds:.2f} s = "
              f"{eng.generated / eng.seconds:.0f} tokens/s (CPU {eng.cpu_seconds:.2f} s); {eng.calls} calls, "
              f"reused {eng.reused} of {eng.prompt} prompt tokens; load {os.getloadavg()[0]:.1f}", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu_rates.items()}
    last = engines["reuse"]
    result = {"decode_tokens_per_s": {k: round(v, 1) for k, v in med.items()},
              "speedup_vs_reprefill": round(med["reuse"] / med["reprefill"], 3),
              "decode_tokens_per_cpu_s": {k: round(v, 1) for k, v in med_cpu.items()},
              "speedup_vs_reprefill_cpu": round(med_cpu["reuse"] / med_cpu["reprefill"], 3),
              "reused_prompt_fraction": round(last.reused / max(last.prompt, 1), 3),
              "generated_tokens_per_round": last.generated, "generate_calls_per_round": last.calls,
              "episodes": args.episodes, "segments": sum(map(len, structures)),
              "turns": sum(sum(isinstance(x, int) for x in seg) for ep in structures for seg in ep),
              "rounds": args.rounds, "same_tokens": bool(same),
              "load_average": [round(x, 2) for x in os.getloadavg()], "backend": jax.default_backend()}
    print(json.dumps(result))
  finally:
    factory.close()


if __name__ == "__main__":
  main()
