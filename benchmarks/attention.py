r"""Attention alone, forward + backward: the whole-block `attend` against the tiled one, in one process.

  python benchmarks/attention.py [--variant colab] [--batch 8] [--seq 256] [--tiles 64,128] [--rounds 7]
  python benchmarks/attention.py --variant small --batch 4 --packed 4

Shapes are one layer's of the named model variant (heads, Q = Qn + R, Dv), f32 like the CPU training step. The
mask is causal over `--packed` equal documents per row (1: one document). Every implementation is jitted as
grad of a weighted sum over (q, k, v), warmed up twice, then the implementations alternate over `--rounds` rounds of
`--reps` calls each; figures are medians over rounds, with the 1-minute load average beside them. Compared:
`attend` (whole block, its own VJP), and `attend_tiled` per tile size in `--tiles` (square tiles; static causal
skipping), each as a scan over tile pairs and unrolled, and with the data-dependent skip of empty tiles.
Last line: JSON with seconds per call per implementation and each one's speedup over `attend`.
"""
import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from composer_jax import configs, model
from composer_jax.model.attention import attend, segment_causal_mask
from composer_jax.model.tiled_attention import Tiling, tiled_attend
from experiments.configs import model as model_configs

jax.config.update("jax_enable_compilation_cache", False)


def implementations(tiles: list[int]) -> dict:
  """name → attention function (q, k, v, mask_BxLxS, scale)."""
  impls = {"attend": attend}
  for t in tiles:
    for suffix, kw in (("scan", {}), ("unrolled", {"unroll": True}), ("skip", {"skip_empty": True})):
      tiling = Tiling(block_q=t, block_k=t, **kw)
      impls[f"tiled{t}_{suffix}"] = lambda q, k, v, m, s, tiling=tiling: tiled_attend(q, k, v, (m,), s, tiling)
  return impls


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="colab")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--packed", type=int, default=1, help="documents per row")
  ap.add_argument("--tiles", default="64,128")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--rounds", type=int, default=7)
  args = ap.parse_args()
  cfg = configs.from_dict(model.ModelConfig, model_configs.get_config(args.variant).to_dict())
  B, L, H = args.batch, args.seq, cfg.num_attention_heads
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (B, L, H, cfg.qk_head_dim))
  k = jax.random.normal(ks[1], (B, L, H, cfg.qk_head_dim))
  v = jax.random.normal(ks[2], (B, L, H, cfg.v_head_dim))
  w = jax.random.normal(ks[3], (B, L, H, cfg.v_head_dim))
  seg = jnp.broadcast_to(jnp.arange(L) * args.packed // L + 1, (B, L)).astype(jnp.int32)
  mask = segment_causal_mask(seg, seg)
  scale = cfg.qk_head_dim ** -0.5
  fns = {name: jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v, mask, scale) * w), argnums=(0, 1, 2)))
         for name, f in implementations([int(t) for t in args.tiles.split(",")]).items()}
  for f in fns.values():
    for _ in range(2):
      jax.block_until_ready(f(q, k, v))
  times = {name: [] for name in fns}
  loads = []
  for r in range(args.rounds):
    loads.append(os.getloadavg()[0])
    for name, f in fns.items():
      t = time.perf_counter()
      for _ in range(args.reps):
        out = f(q, k, v)
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - t) / args.reps)
    print(f"round {r}: " + "  ".join(f"{n} {times[n][-1] * 1e3:.2f} ms" for n in fns) + f"  load {loads[-1]:.1f}")
  med = {n: statistics.median(t) for n, t in times.items()}
  result = {"variant": args.variant, "batch": B, "seq": L, "packed": args.packed, "heads": H,
            "seconds": med, "speedup_vs_attend": {n: med["attend"] / s for n, s in med.items()},
            "load_average": statistics.mean(loads)}
  for n in fns:
    print(f"{n:>20}: {med[n] * 1e3:8.2f} ms  {med['attend'] / med[n]:5.2f}x attend")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
