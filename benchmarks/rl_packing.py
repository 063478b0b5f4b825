r"""The RL step on a packed batch (`rl.pack_rows`) against the same groups unpacked (a row per segment), in one
process.

  PYTHONPATH=. python benchmarks/rl_packing.py [--variant rl_colab] [--rows 48] [--pack_rows 24] [--length 496]
      [--steps 3]
                                  [--rounds 5]

The groups are shaped as the recipe's harness makes them (`rl.py:recipe`, measured with the scripted oracle): 8
trajectories a group; a level-1 episode is one segment of 155-177 tokens, level 2 one of 211-247, level 3 a chain
of 2-3 segments of 256-496 (the summary is asked for past 256 tokens of context, so two level-3 segments rarely
share a row). Levels are drawn at random (an even mix) and lengths uniformly in those ranges, with a fixed seed; the
first 64 tokens of each segment are its prompt. The step takes groups as `take_groups` does: in order, until the
next does not pack into `--pack_rows` rows, or `--groups` are taken. Both batches hold exactly these groups, so the
steps compute the same loss (`tests/test_rl_packing.py`); only the rows differ. Routing is recorded at every
position (as the JAX and SGLang engines report it), so each step runs the reference and policy forwards and one
backward.

Method: the two steps alternate over `--rounds` rounds of `--steps` steps each after 2 warm-up steps; figures are
medians over rounds, with the load average (1 min) beside them. Last line: JSON with `packed_vs_unpacked` (step
time ratio), the rows of each and the packed rows' fill.
"""
import argparse
import os
import statistics

import jax
import numpy as np

from benchmarks import rl_step as rl_bench
from benchmarks import train_step as lm_bench
from composer_jax import configs, model
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import step as rl_step
from experiments.configs import model as model_configs

LEVEL_SEGMENTS = {1: ((1, 1), (155, 177)), 2: ((1, 1), (211, 247)), 3: ((2, 3), (256, 496))}
PROMPT = 64


def group(cfg, level: int, rng, group_size: int = 8) -> list[dict]:
  """A group of `level`: each trajectory's segments with random tokens, engine logprobs and full routing."""
  n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
  (lo_s, hi_s), (lo_t, hi_t) = LEVEL_SEGMENTS[level]
  trajs = []
  for i in range(group_size):
    segs = []
    for _ in range(rng.integers(lo_s, hi_s + 1)):
      T = int(rng.integers(lo_t, hi_t + 1))
      experts = np.argsort(rng.random((T, n_moe, cfg.n_routed_experts)), -1)[..., :cfg.num_experts_per_tok]
      segs.append({"tokens_T": rng.integers(1, cfg.vocab_size, T).astype(np.int32),
                   "gen_mask_T": (np.arange(T) >= PROMPT).astype(np.int8),
                   "logprobs_T": -rng.uniform(0.01, 2.0, T).astype(np.float32),
                   "routed_TxNxK": experts.astype(np.int32)})
    trajs.append({"task_id": f"l{level}", "reward": float(i % 2), "segments": segs})
  return trajs


def step_groups(cfg, rows: int, pack_rows: int, length: int, max_groups: int, seed: int = 0) -> list[list[dict]]:
  """Groups of random levels in order, while they pack (`rl_batch.Packer`, as `take_groups` checks them)."""
  rng = np.random.default_rng(seed)
  packer, out = rl_batch.Packer(pack_rows, length, rows), []
  while len(out) < max_groups:
    g = group(cfg, int(rng.integers(1, 4)), rng)
    if packer.add(rl_batch.segment_lengths(g)) is None:
      break
    out.append(g)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--variant", default="rl_colab")
  ap.add_argument("--rows", type=int, default=48, help="segments a step holds (rl.rows_per_step)")
  ap.add_argument("--pack_rows", type=int, default=24, help="rows the packed batch has (rl.pack_rows)")
  ap.add_argument("--length", type=int, default=496, help="row length (harness.context_budget)")
  ap.add_argument("--groups", type=int, default=4, help="most groups a step takes (rl.groups_per_step)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--rounds", type=int, default=5)
  args = ap.parse_args()
  cfg = configs.from_dict(model.ModelConfig, {**model_configs.get_config(args.variant).to_dict(),
                                              "num_nextn_predict_layers": 0})
  params = model.init(jax.random.key(0), cfg)
  gs = step_groups(cfg, args.rows, args.pack_rows, args.length, args.groups, args.seed)
  kw = dict(rows=args.rows, length=args.length, n_moe_layers=cfg.num_hidden_layers - cfg.first_k_dense_replace,
            top_k=cfg.num_experts_per_tok)
  unpacked = rl_batch.make_batch(gs, rl_batch.BatchConfig(**kw))
  packed = rl_batch.make_batch(gs, rl_batch.BatchConfig(**kw, pack_rows=args.pack_rows))
  real = int((packed["segment_ids"] > 0).sum())
  rl_cfg = rl_step.RLConfig(unreplayed_every=0)
  run = {"unpacked": rl_bench.rl_runner(cfg, params, unpacked, rl_cfg),
         "packed": rl_bench.rl_runner(cfg, params, packed, rl_cfg)}
  med, loads = rl_bench.alternate(run, args.rounds, args.steps)
  lm_bench.report({"variant": args.variant, "groups": len(gs), "segments": int(unpacked["valid"].sum()), "tokens": real,
                   "unpacked_rows": int(unpacked["tokens"].shape[0]), "packed_rows": args.pack_rows,
                   "packed_fill": real / (args.pack_rows * args.length),
                   "unpacked_fill": real / (unpacked["tokens"].shape[0] * args.length),
                   "packed_vs_unpacked": med["packed"] / med["unpacked"], "packed_step_s": med["packed"],
                   "unpacked_step_s": med["unpacked"], "rounds": args.rounds, "steps_per_round": args.steps,
                   "load_average": statistics.mean(loads), "load_average_end": os.getloadavg()[0]})


if __name__ == "__main__":
  main()
