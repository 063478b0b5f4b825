r"""Grouped-matmul benchmark: TFLOP/s of bf16 `lax.ragged_dot`, our bf16 / MXFP8 / NVFP4 Pallas kernels, and dense
bf16 `jnp.dot` (the peak reference measured in the same run), at MoE shapes.

  python benchmarks/grouped_matmul.py                 # GPU: timings; CPU: interpret-mode correctness only
  python benchmarks/grouped_matmul.py --quick         # GPU: one shape

The last line of stdout is one JSON object. On GPU it holds per-shape TFLOP/s and `mxfp8_vs_bf16_ragged` (geometric
mean over shapes of MXFP8 kernel TFLOP/s / bf16 ragged_dot TFLOP/s; issue 5 targets >= 1.5 on H200). On CPU it holds
the interpret-mode errors vs the jnp reference, `gpu_measured: false`, and null GPU figures: nothing is invented.
Quantisation of the operands is not timed (weights are quantised once per step, activations by the previous layer's
epilogue in a fused pipeline); FLOPs count 2*T*K*N (the useful work, not the tiles recomputed at group boundaries).
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import formats
from kernels_pallas.grouped_matmul import BlockSizes, grouped_matmul, grouped_matmul_reference

GPU_SHAPES = [(16384, k, n, e) for k, n in ((2048, 2048), (4096, 4096), (7168, 2048), (2048, 7168)) for e in (8, 64)]


def _operands(t, k, n, e, seed=0):
  kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (t, k), jnp.float32)
  w = jax.random.normal(kw, (e, k, n), jnp.float32) / np.sqrt(k)
  # Uneven, realistic routing: Dirichlet-like sizes summing to T, one expert empty when E > 4.
  p = np.asarray(jax.random.gamma(kg, 1.0, (e,)))
  if e > 4:
    p[1] = 0.0
  gs = np.floor(p / p.sum() * t).astype(np.int32)
  gs[0] += t - gs.sum()
  return x, w, jnp.asarray(gs)


def _time(f, *args, iters=20) -> float:
  """Median seconds per call of a jitted function (after compile + warm-up)."""
  jax.block_until_ready(f(*args))
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def gpu_benchmark(shapes, block_sizes: BlockSizes) -> dict:
  rows, ratios = [], []
  for t, k, n, e in shapes:
    x, w, gs = _operands(t, k, n, e)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    flops = 2.0 * t * k * n
    row = {"T": t, "K": k, "N": n, "E": e}
    cases = {
      "dense_bf16_dot": (jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)), (xb, wb[0])),
      "ragged_dot_bf16": (jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32)),
                          (xb, wb, gs)),
    }
    for fmt in formats.FORMATS:
      a = formats.quantize(x, fmt, axis=1)
      b = formats.quantize(w, fmt, axis=1, batch_dims=1)
      cases[f"pallas_{fmt}"] = (jax.jit(lambda a, b, g: grouped_matmul(a, b, g, block_sizes=block_sizes)), (a, b, gs))
    for name, (f, args) in cases.items():
      row[f"{name}_tflops"] = round(flops / _time(f, *args) / 1e12, 2)
    ratios.append(row["pallas_mxfp8_tflops"] / row["ragged_dot_bf16_tflops"])
    rows.append(row)
    print(row, flush=True)
  return {"shapes": rows, "mxfp8_vs_bf16_ragged": round(float(np.exp(np.mean(np.log(ratios)))), 3)}


def cpu_correctness(block_sizes: BlockSizes) -> dict:
  """Interpret-mode kernel vs reference at a small shape with an empty group and a partial tile."""
  x, w, _ = _operands(72, 64, 32, 4)
  gs = jnp.array([30, 0, 25, 17], jnp.int32)
  out = {}
  for fmt in formats.FORMATS:
    a, b = formats.quantize(x, fmt, axis=1), formats.quantize(w, fmt, axis=1, batch_dims=1)
    got = grouped_matmul(a, b, gs, out_dtype=jnp.float32, block_sizes=block_sizes, interpret=True)
    ref = grouped_matmul_reference(a, b, gs)
    exact = jax.lax.ragged_dot(x, w, gs, precision=jax.lax.Precision.HIGHEST)
    out[fmt] = {"kernel_vs_reference_max_rel": float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))),
                "format_vs_f32_rel_norm": float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))}
    print(fmt, out[fmt], flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="GPU: only the first shape")
  parser.add_argument("--block_m", type=int, default=128)
  parser.add_argument("--block_n", type=int, default=128)
  parser.add_argument("--block_k", type=int, default=64)
  parser.add_argument("--num_warps", type=int, default=8)
  parser.add_argument("--num_stages", type=int, default=3)
  args = parser.parse_args()
  bs = BlockSizes(args.block_m, args.block_n, args.block_k, args.num_warps, args.num_stages)
  backend = jax.default_backend()
  result = {"backend": backend, "device": str(jax.devices()[0].device_kind)}
  if backend == "gpu":
    result.update(gpu_measured=True, block_sizes=vars(args))
    result.update(gpu_benchmark(GPU_SHAPES[:1] if args.quick else GPU_SHAPES, bs))
  else:
    result.update(gpu_measured=False, note="no GPU: interpret-mode correctness only; GPU TFLOP/s not measured",
                  correctness=cpu_correctness(BlockSizes(16, 16, 32)), mxfp8_vs_bf16_ragged=None, shapes=None)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
