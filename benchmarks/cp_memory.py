r"""Per-device activation memory of a long-context training step under context parallelism, CP = 1, 2, 4, 8.

  python benchmarks/cp_memory.py [--variant tiny] [--seq 8192] [--batch 1] [--impl ring] [--block 512]
  python benchmarks/cp_memory.py --inner --variant kimi_k2 --seq 32768 --cp 4

Compiles (never runs) forward + backward of the training loss (`train.step.loss_fn`, MTP on) on a mesh of CP fake
CPU devices with the whole sequence sharded over `context`, and reads the per-device sizes from the compiled
executable's `memory_analysis()`. Activation memory is the temp (scratch) size: arguments (params replicated over
`context`, the batch) and outputs (gradients) are not activations. Ideal scaling is temp(CP=1) / CP; the ratio
measured / ideal is printed per CP and the worst one goes into the last line's JSON as `cp_memory_vs_ideal`
(target <= 1.3). CP = 1 runs the same `attention_impl` on a one-device mesh (a single block).

Each CP is compiled twice: with ring blocks tiled in `--block` x `--block` tiles (`cfg.ring_block`) and with one
tile per block (block = seq: the untiled block, [B, H, L/CP, L/CP] logits and probabilities); the last line gives
both temps per CP and `tiled_vs_untiled_temp`, their ratio at the largest CP.

Untiled, ratios below 1 are expected at long sequences: the CP = 1 step holds full L x L score matrices, while a
ring step holds one (L/CP) x (L/2CP) block, so the quadratic term falls as 1/CP^2. Tiled, no step holds more than
one [B, H, block, block] tile, the quadratic term is gone at every CP (CP = 1 included), and what stays is the
linear part (activations [L/CP, D], the latent KV blocks, one running accumulator, and per-device copies that do not
shrink with CP), so the ratio to temp(CP=1)/CP rises above 1 while every temp is far below the untiled one.

`--inner` compiles only ring attention's forward + backward (one layer's `ring_attention`, the variant's heads and
MLA dims, random inputs) at `--cp` devices, tiled and untiled: the memory of the ring's inner block at real head
counts (kimi_k2 at 32k tokens over CP = 4: L/CP = 8192), which the whole step of a large model is too big to
compile here. Last line: `inner_temp_bytes` and `inner_untiled_temp_bytes`.
"""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import configs, model
from composer_jax.parallel import make_mesh
from composer_jax.train.config import TrainConfig
from composer_jax.train.step import loss_fn
from experiments.configs import model as model_configs


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


def inner_memory(cfg: model.ModelConfig, cp: int, batch: int, seq: int) -> int:
  """Temp bytes per device of grad(ring_attention) alone on a `context`=cp mesh (compiled, not run)."""
  from composer_jax.model import context_parallel
  mesh = make_mesh({"context": cp}, devices=jax.devices()[:cp])
  seq_sh = NamedSharding(mesh, P(None, "context"))
  dt = jnp.dtype(cfg.compute_dtype)
  H, Qn, R, Dv, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
  arg = lambda shape, dtype=dt, sh=seq_sh: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
  rep = NamedSharding(mesh, P())
  q, c, kr = arg((batch, seq, H, Qn + R)), arg((batch, seq, C)), arg((batch, seq, R))
  ints = arg((batch, seq), jnp.int32)
  kvb = {"k_b": arg((C, H, Qn), sh=rep), "v_b": arg((C, H, Dv), sh=rep)}

  def loss(q, c, kr, kvb, seg, idx):
    out = context_parallel.ring_attention(q, c, kr, seg, idx, kvb, 0.1, cfg.ring_block)
    return jnp.sum(out.astype(jnp.float32))
  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, c, kr, kvb, ints, ints).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="tiny")
  ap.add_argument("--seq", type=int, default=8192)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--impl", default="ring", choices=["ring", "allgather"])
  ap.add_argument("--block", type=int, default=512, help="tile size inside each ring block (cfg.ring_block)")
  ap.add_argument("--inner", action="store_true", help="ring attention alone at the variant's head dims")
  ap.add_argument("--cp", type=int, default=4, help="context size for --inner")
  args = ap.parse_args()
  cfg = configs.from_dict(model.ModelConfig, model_configs.get_config(args.variant).to_dict())
  cfg = dataclasses.replace(cfg, attention_impl=args.impl, max_position_embeddings=args.seq, ring_block=args.block)
  if args.inner:
    tiled = inner_memory(cfg, args.cp, args.batch, args.seq)
    untiled = inner_memory(dataclasses.replace(cfg, ring_block=args.seq), args.cp, args.batch, args.seq)
    print(f"{args.variant} ring attention alone, batch {args.batch} x {args.seq} tokens over CP = {args.cp}, "
          f"{cfg.compute_dtype}: temp per device {tiled / 2**30:.2f} GiB in tiles of {args.block}, "
          f"{untiled / 2**30:.2f} GiB untiled")
    print(json.dumps({"variant": args.variant, "seq": args.seq, "cp": args.cp, "block": args.block,
                      "inner_temp_bytes": tiled, "inner_untiled_temp_bytes": untiled}))
    return
  rows = {cp: step_memory(cfg, cp, args.batch, args.seq) for cp in (1, 2, 4, 8)}
  untiled = {cp: step_memory(dataclasses.replace(cfg, ring_block=args.seq), cp, args.batch, args.seq)["temp"]
             for cp in (1, 2, 4, 8)}
  base = rows[1]["temp"]
  print(f"{args.variant} model, impl={args.impl}, batch {args.batch} x {args.seq} tokens, tiles of {args.block}; "
        "per-device MiB")
  print(f"{'CP':>3} {'temp':>10} {'ideal':>10} {'ratio':>6} {'args':>8} {'out':>8} {'untiled':>10}")
  for cp, r in rows.items():
    r["ratio"] = r["temp"] / (base / cp)
    print(f"{cp:>3} {r['temp'] / 2**20:>10.1f} {base / cp / 2**20:>10.1f} {r['ratio']:>6.2f} "
          f"{r['argument'] / 2**20:>8.2f} {r['output'] / 2**20:>8.2f} {untiled[cp] / 2**20:>10.1f}")
  print(json.dumps({"cp_memory_vs_ideal": round(max(rows[cp]["ratio"] for cp in (2, 4, 8)), 3), "impl": args.impl,
                    "seq": args.seq, "block": args.block,
                    "temp_bytes_per_cp": {str(cp): r["temp"] for cp, r in rows.items()},
                    "untiled_temp_bytes_per_cp": {str(cp): t for cp, t in untiled.items()},
                    "tiled_vs_untiled_temp": round(rows[8]["temp"] / untiled[8], 3),
                    "ratio_per_cp": {str(cp): round(r["ratio"], 3) for cp, r in rows.items()}}))


if __name__ == "__main__":
  main()
