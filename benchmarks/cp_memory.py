r"""Per-device activation memory of a long-context training step under context parallelism, CP = 1, 2, 4, 8.

  python benchmarks/cp_memory.py [--variant tiny] [--seq 8192] [--batch 1] [--impl ring]

Compiles (never runs) forward + backward of the training loss (`train.step.loss_fn`, MTP on) on a mesh of CP fake
CPU devices with the whole sequence sharded over `context`, and reads the per-device sizes from the compiled
executable's `memory_analysis()`. Activation memory is the temp (scratch) size: arguments (params replicated over
`context`, the batch) and outputs (gradients) are not activations. Ideal scaling is temp(CP=1) / CP; the ratio
measured / ideal is printed per CP and the worst one goes into the last line's JSON as `cp_memory_vs_ideal`
(target <= 1.3). CP = 1 runs the same `attention_impl` on a one-device mesh (a single block: dense attention).

Ratios below 1 are expected at long sequences: the CP = 1 step holds full L x L score matrices, while a ring step
holds one (L/CP) x (L/2CP) block, so the quadratic term falls as 1/CP^2; what stays is the linear part
(activations [L/CP, D], the latent KV blocks and one running accumulator per step kept for the backward pass).
"""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from composer_jax import (
  configs,  # noqa: E402
  model,  # noqa: E402
)
from composer_jax.parallel import make_mesh  # noqa: E402
from composer_jax.train.config import TrainConfig  # noqa: E402
from composer_jax.train.step import loss_fn  # noqa: E402
from experiments.configs import model as model_configs  # noqa: E402


def step_memory(cfg: model.ModelConfig, cp: int, batch: int, seq: int) -> dict:
  """Compiles grad(loss) on a `context`=cp mesh; returns the per-device memory analysis in bytes."""
  mesh = make_mesh({"context": cp}, devices=jax.devices()[:cp])
  p_shard = model.shardings(cfg, mesh)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), cfg))
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, p_shard)
  seq_sharding = NamedSharding(mesh, P(None, "context"))
  ints = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=seq_sharding)
  data = {"tokens": ints, "segment_ids": ints, "positions": ints, "loss_mask": ints}
  grad = jax.grad(lambda p, b: loss_fn(p, b, cfg, TrainConfig(mtp_loss="cross_entropy"))[0])
  with jax.set_mesh(mesh):
    compiled = jax.jit(grad, out_shardings=p_shard).lower(params, data).compile()
  m = compiled.memory_analysis()
  return {"temp": m.temp_size_in_bytes, "argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="tiny")
  ap.add_argument("--seq", type=int, default=8192)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--impl", default="ring", choices=["ring", "allgather"])
  args = ap.parse_args()
  cfg = configs.from_dict(model.ModelConfig, model_configs.get_config(args.variant).to_dict())
  cfg = dataclasses.replace(cfg, attention_impl=args.impl, max_position_embeddings=args.seq)
  rows = {cp: step_memory(cfg, cp, args.batch, args.seq) for cp in (1, 2, 4, 8)}
  base = rows[1]["temp"]
  print(f"{args.variant} model, impl={args.impl}, batch {args.batch} x {args.seq} tokens; per-device MiB")
  print(f"{'CP':>3} {'temp':>10} {'ideal':>10} {'ratio':>6} {'args':>8} {'out':>8}")
  for cp, r in rows.items():
    r["ratio"] = r["temp"] / (base / cp)
    print(f"{cp:>3} {r['temp'] / 2**20:>10.1f} {base / cp / 2**20:>10.1f} {r['ratio']:>6.2f} "
          f"{r['argument'] / 2**20:>8.2f} {r['output'] / 2**20:>8.2f}")
  print(json.dumps({"cp_memory_vs_ideal": round(max(rows[cp]["ratio"] for cp in (2, 4, 8)), 3), "impl": args.impl,
                    "seq": args.seq, "temp_bytes_per_cp": {str(cp): r["temp"] for cp, r in rows.items()},
                    "ratio_per_cp": {str(cp): round(r["ratio"], 3) for cp, r in rows.items()}}))


if __name__ == "__main__":
  main()
