r"""Expert-parallel MoE layer: bytes each device sends per token, read from the HLO, vs the analytic minimum.

  python benchmarks/ep_bytes.py [--hidden 512] [--experts 64] [--top_k 8] [--tokens 256]

Compiles (never runs) one MoE layer's routed experts (`composer_jax.model.expert_parallel.expert_parallel`) on a mesh of
8 fake CPU devices and sums the operand sizes of the per-device all-to-alls in the compiled HLO (`ep_capacity`), or
of the ragged-all-to-alls in the cuda lowering (`ep_ragged`: XLA:CPU cannot compile it), divided by the tokens per
device. The minimum is one copy of each token per chosen expert out and back: 2 x top_k x hidden x bytes.
The capacity path's ratio is its capacity factor (rounded up to whole slots). For the ragged path the table shows
its static *buffers*: the dispatch operand is exactly t x top_k rows (all sent), the return operand is the
worst-case N x t x top_k receive buffer of which only the received rows are sent, so the bytes actually sent
average exactly the minimum (ratio 1.0) and the buffer ratio is (1 + N) / 2. Counted bytes include the 1/N of each
exchange that stays on its own device. Default dtype float32: XLA:CPU upcasts bf16 collectives to f32 in its
compiled HLO (the `lowered` column, from the cuda lowering, keeps bf16). Last line: JSON with `ep_bytes_vs_min`
(capacity path, capacity factor 1.25, expert=8, forward), `ep_bytes_vs_min_fwd_bwd` (a training step's four
exchanges vs 2x the minimum), `ep_ragged_buffer_vs_min` and every row.
"""
import argparse
import dataclasses
import json
import math
import os
import re

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.model import ModelConfig
from composer_jax.model.expert_parallel import expert_parallel
from composer_jax.parallel import make_mesh

_HLO_SHAPE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")   # f32, f8e4m3fn, ...
_MLIR_SHAPE = re.compile(r"tensor<([\dx]+)x([a-z]+\d+[A-Za-z0-9]*)>")  # f32, f8E4M3FN, ...


_BITS = {"pred": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "s8": 8, "u8": 8, "s32": 32, "u32": 32, "i1": 8,
         "i8": 8, "i32": 32, "i64": 64, "s64": 64, "f8e4m3fn": 8, "f8e5m2": 8}


def _nbytes(dtype: str, dims: list[int]) -> int:
  dtype = dtype.lower()
  if dtype not in _BITS:
    raise ValueError(f"unknown HLO element type {dtype!r} in a collective; add it to _BITS")
  return math.prod(dims) * _BITS[dtype] // 8


def hlo_all_to_all_bytes(hlo_text: str) -> int:
  """Sum of operand bytes of every `all-to-all` in per-device compiled HLO text.

  Compiled HLO names operands without their shapes; an all-to-all's result has its operands' shapes, so the
  (possibly tuple) result type left of the op name is what is summed.
  """
  total = 0
  for line in hlo_text.splitlines():
    if " all-to-all(" not in line or " = " not in line:
      continue
    result_type = line.split(" = ", 1)[1].split(" all-to-all(", 1)[0]
    for dtype, dims in _HLO_SHAPE.findall(result_type):
      total += _nbytes(dtype, [int(d) for d in dims.split(",") if d])
  return total


def mlir_exchange_bytes(mlir_text: str) -> int:
  """Sum of the send operand's bytes of every all_to_all / ragged_all_to_all in (per-device) StableHLO text."""
  total = 0
  for line in mlir_text.splitlines():
    if "stablehlo.all_to_all" not in line and "custom_call @ragged_all_to_all" not in line:
      continue
    dims, dtype = _MLIR_SHAPE.findall(line.rsplit(" : (", 1)[1])[0]
    total += _nbytes(dtype, [int(d) for d in dims.split("x")])
  return total


def layer_inputs(cfg: ModelConfig, n_devices: int, tokens_per_device: int, seed: int = 0):
  """Random params and routing for one layer: B = n_devices rows of `tokens_per_device` tokens."""
  D, E, F, K = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
  dt = jnp.dtype(cfg.compute_dtype)
  rng = np.random.default_rng(seed)
  p = {"gate": jnp.asarray(rng.normal(size=(E, D, F)), dt), "up": jnp.asarray(rng.normal(size=(E, D, F)), dt),
       "down": jnp.asarray(rng.normal(size=(E, F, D)), dt)}
  B, L = n_devices, tokens_per_device
  x = jnp.asarray(rng.normal(size=(B, L, D)), dt)
  idx = jnp.asarray(np.argsort(rng.random((B, L, E)), -1)[..., :K], jnp.int32)
  w = jnp.full((B, L, K), 1.0 / K, jnp.float32)
  return p, x, idx, w, jnp.ones((B, L), bool)


def measure(cfg: ModelConfig, axes: dict[str, int], tokens_per_device: int,
            backward: bool) -> tuple[float, float | None]:
  """Bytes sent per token per device by the EP layer's exchanges (forward, or forward + backward).

  Returns (from the cuda lowering's StableHLO, from the XLA:CPU compiled HLO or None for ep_ragged).
  """
  mesh = make_mesh(axes)
  args = layer_inputs(cfg, mesh.size, tokens_per_device)

  def f(p, x, idx, w, valid):
    y, _ = expert_parallel(p, x, idx, w, valid, cfg)
    return y.astype(jnp.float32).sum()

  # value_and_grad, as a training step needs the loss: with grad alone XLA drops the forward's return exchange.
  fn = jax.value_and_grad(f, argnums=(0, 1)) if backward else f
  with jax.set_mesh(mesh):
    traced = jax.jit(fn).trace(*args)
    lowered = mlir_exchange_bytes(traced.lower(lowering_platforms=("cuda",)).as_text())
    compiled = None
    if cfg.moe_impl == "ep_capacity":
      compiled = hlo_all_to_all_bytes(traced.lower().compile().as_text())
  return lowered / tokens_per_device, None if compiled is None else compiled / tokens_per_device


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--hidden", type=int, default=512)
  ap.add_argument("--experts", type=int, default=64)
  ap.add_argument("--top_k", type=int, default=8)
  ap.add_argument("--ffw", type=int, default=64)
  ap.add_argument("--tokens", type=int, default=256, help="tokens per device")
  ap.add_argument("--dtype", default="float32")
  a = ap.parse_args()
  base = ModelConfig(hidden_size=a.hidden, n_routed_experts=a.experts, num_experts_per_tok=a.top_k,
                     moe_intermediate_size=a.ffw, compute_dtype=a.dtype, param_dtype=a.dtype)
  minimum = 2 * a.top_k * a.hidden * jnp.dtype(a.dtype).itemsize
  rows = []
  for impl, cf, axes in (("ep_capacity", 1.25, {"expert": 8}), ("ep_capacity", 1.0, {"expert": 8}),
                         ("ep_capacity", 2.0, {"expert": 8}), ("ep_capacity", 1.25, {"data": 2, "expert": 4}),
                         ("ep_ragged", None, {"expert": 8}), ("ep_ragged", None, {"data": 2, "expert": 4})):
    cfg = dataclasses.replace(base, moe_impl=impl, capacity_factor=cf or 1.0)
    lowered, compiled = measure(cfg, axes, a.tokens, backward=False)
    lowered_fb, compiled_fb = measure(cfg, axes, a.tokens, backward=True)
    # The compiled HLO is the ground truth where XLA:CPU can compile (ep_capacity); ep_ragged has only the lowering.
    fwd, fwd_bwd = (compiled, compiled_fb) if compiled is not None else (lowered, lowered_fb)
    rows.append({"impl": impl, "capacity_factor": cf, "mesh": "x".join(f"{k}={v}" for k, v in axes.items()),
                 "bytes_per_token": fwd, "lowered_bytes_per_token": lowered, "ratio": fwd / minimum,
                 "fwd_bwd_ratio": fwd_bwd / (2 * minimum), "source": "compiled" if compiled is not None else "cuda"})
  print(f"hidden={a.hidden} experts={a.experts} top_k={a.top_k} tokens/device={a.tokens} dtype={a.dtype}: "
        f"minimum 2*K*D*bytes = {minimum} bytes/token")
  print(f"{'impl':12} {'cf':>5} {'mesh':>17} {'HLO':>8} {'bytes/token':>12} {'(lowered)':>10} {'vs min':>7} "
        f"{'fwd+bwd vs 2*min':>17}")
  for r in rows:
    print(f"{r['impl']:12} {r['capacity_factor'] or '-':>5} {r['mesh']:>17} {r['source']:>8} "
          f"{r['bytes_per_token']:12.0f} {r['lowered_bytes_per_token']:10.0f} {r['ratio']:7.3f} "
          f"{r['fwd_bwd_ratio']:17.3f}")
  head = rows[0]
  print(json.dumps({"ep_bytes_vs_min": round(head["ratio"], 4), "ep_bytes_per_token": head["bytes_per_token"],
                    "min_bytes_per_token": minimum, "capacity_factor": head["capacity_factor"],
                    "ep_bytes_vs_min_fwd_bwd": round(head["fwd_bwd_ratio"], 4),
                    "ep_ragged_buffer_vs_min": round(rows[4]["ratio"], 4),
                    "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}))


if __name__ == "__main__":
  main()
