r"""The one-GPU check (`benchmarks/gpu_check.sh` runs it in a fresh venv): kernels, throughput, decoding, dropless EP.

  python benchmarks/gpu_check.py            # on a GPU (about 5 min on one H200 after installation)
  python benchmarks/gpu_check.py --dry      # on CPU: tiny shapes, interpret-mode kernels (what the tests run)

Sections, each a key of the JSON object printed as the last line:
- `kernels`: our Pallas grouped matmul (forward) and the MoE matmul's gradients (Pallas forward + transposed
  kernel backward) for bf16, MXFP8 and NVFP4, compiled and run against their jnp references; max relative error
  and whether it is within the kernel tests' tolerance for the format (`KERNEL_TOL`).
- `grouped_matmul`: TFLOP/s per format and `mxfp8_vs_bf16_ragged` at the MoE shapes of
  `benchmarks/grouped_matmul.py` (its `gpu_benchmark`; dense bf16 `jnp.dot` measured beside as the peak).
- `train_small`: the `small` config's LM train step (bf16, the trainer's jitted step with explicit shardings)
  tokens/s, and MFU against the H200's 989 TFLOP/s bf16 dense peak (model FLOPs: `train_step.model_flops_per_step`).
- `decode`: the embedded engine's greedy decode tokens/s at batch 1 and 32, plain and MTP speculative
  (1 draft token), and their ratio; and the adaptive engine (k chosen in 0..2 from each k's decode tokens/s on the
  same calls, `sampling/draft_depth.py`): its tokens/s, ratio, the k it chose and tokens per trunk forward. The MTP
  heads are random unless `--pretrain_workdir` gives trained params, and `mtp_heads` says which: random heads
  accept few drafts, so that speedup measures the machinery, not MTP.
- `ep_ragged`: the dropless expert-parallel MoE layer (`lax.ragged_all_to_all`, which XLA:CPU lacks) run on a
  one-device mesh, against the dense one-hot reference (`experts.experts_dense`). `--dry` swaps in the padded
  all-to-all reference exchange.
Timings are medians / best-of with warm-up excluded; `load_avg` is printed beside them.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))

H200_BF16_FLOPS = 989e12          # NVIDIA H200 datasheet, dense (no sparsity)
KERNEL_TOL = {"bf16": 2e-2, "mxfp8": 2e-2, "nvfp4": 2e-2}   # max |kernel - reference| / max |reference|: same
# quantised operands on both sides, so only accumulation order and the output cast (bf16: 2^-8) differ.


def _bench_module(name: str):
  """Imports a sibling benchmark script as a module (they are scripts, not a package)."""
  spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(_HERE, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check_kernels(dry: bool) -> dict:
  """Forward and gradients of the grouped matmuls vs their references, per format."""
  from kernels_pallas import formats
  from kernels_pallas.grouped_matmul import BlockSizes, grouped_matmul, grouped_matmul_reference
  from kernels_pallas.moe_matmul import moe_matmul
  t, k, n, e = (72, 64, 32, 4) if dry else (4096, 2048, 1024, 16)
  bs = BlockSizes(16, 16, 32) if dry else BlockSizes()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(t, k)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(e, k, n)) / np.sqrt(k), jnp.float32)
  sizes = rng.multinomial(t, rng.dirichlet(np.ones(e)))
  sizes[1] += sizes[0]
  sizes[0] = 0                                   # an empty group, as routing produces
  gs = jnp.asarray(sizes, jnp.int32)
  ct = jnp.asarray(rng.normal(size=(t, n)), jnp.float32)
  out = {}
  for fmt in formats.FORMATS:
    a, b = formats.quantize(x, fmt, axis=1), formats.quantize(w, fmt, axis=1, batch_dims=1)
    got = jax.jit(lambda a, b, g: grouped_matmul(a, b, g, out_dtype=jnp.float32, block_sizes=bs, interpret=dry))(
        a, b, gs)
    fwd = _rel(got, grouped_matmul_reference(a, b, gs))

    def grads(impl, fmt=fmt, **kw):
      f = lambda x, w: jnp.sum(moe_matmul(x, w, gs, matmul=fmt, impl=impl, **kw).astype(jnp.float32) * ct)
      return jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    g_kernel, g_ref = grads("pallas", interpret=dry, block_sizes=bs), grads("reference")
    bwd = max(_rel(g_kernel[0], g_ref[0]), _rel(g_kernel[1], g_ref[1]))
    out[fmt] = {"forward_max_rel": fwd, "grad_max_rel": bwd, "ok": fwd <= KERNEL_TOL[fmt] and bwd <= KERNEL_TOL[fmt]}
  out["shape"] = {"T": t, "K": k, "N": n, "E": e}
  return out


def grouped_matmul_speed(dry: bool) -> dict:
  """TFLOP/s per format and the MXFP8 / bf16 ragged_dot ratio (GPU only: interpret mode times nothing real)."""
  if dry:
    return {"measured": False, "note": "--dry: interpret mode, no timings"}
  gm = _bench_module("grouped_matmul")
  res = gm.gpu_benchmark(gm.GPU_SHAPES, gm.BlockSizes())
  per_format = {}
  for key in res["shapes"][0]:
    if key.endswith("_tflops"):
      vals = [r[key] for r in res["shapes"]]
      per_format[key] = round(float(np.exp(np.mean(np.log(vals)))), 2)    # geometric mean over shapes
  return {"measured": True, "mxfp8_vs_bf16_ragged": res["mxfp8_vs_bf16_ragged"], "tflops_geomean": per_format,
          "shapes": res["shapes"]}


def train_small(dry: bool, steps: int) -> dict:
  """The LM train step's tokens/s and MFU (bf16) on one device, as the trainer builds it."""
  from composer_jax import configs, model
  from experiments.configs import model as model_configs
  ts = _bench_module("train_step")
  variant, B, L = ("tiny", 2, 64) if dry else ("small", 16, 2048)
  d = model_configs.get_config(variant).to_dict()
  d.update(num_nextn_predict_layers=0, param_dtype="bfloat16", compute_dtype="bfloat16")
  cfg = configs.from_dict(model.ModelConfig, d)
  params = model.init(jax.random.key(0), cfg)
  run, compile_s = ts.ours(cfg, params, ts.lm_batch(cfg, B, L))
  step_s = float(np.median([run(max(1, steps // 5)) for _ in range(5)]))   # 5 timed rounds, warm-up excluded
  flops = ts.model_flops_per_step(cfg, B, L)
  return {"variant": variant, "batch": B, "seq": L, "dtype": "bfloat16", "step_s": step_s, "compile_s": compile_s,
          "tokens_per_s": B * L / step_s, "mfu_vs_h200_bf16_peak": flops / step_s / H200_BF16_FLOPS,
          "model_tflops_per_step": flops / 1e12}


def decode(dry: bool, repeats: int, workdir: str | None) -> dict:
  """Plain vs MTP-speculative greedy decoding tokens/s at batch 1 and 32 (runs interleaved, best of `repeats`)."""
  from composer_jax.sampling.engine import EngineConfig, JaxEngine
  rb = _bench_module("jax_engine")
  variant, tokens, prompt_len = ("tiny", 8, 8) if dry else ("small", 128, 64)
  cfg = rb.model_config(variant)
  params, heads = rb.load_or_random(cfg, workdir)
  out = {"variant": variant, "tokens": tokens, "prompt_len": prompt_len, "mtp_heads": heads}
  for b in (1, 32):
    ecfg = EngineConfig(min_prompt_bucket=prompt_len, min_len_bucket=tokens, max_batch=32, min_batch_bucket=b)
    engines = {"plain": JaxEngine(params, cfg, ecfg),
               "mtp": JaxEngine(params, cfg, dataclasses.replace(ecfg, speculative=True, draft_tokens=1)),
               "adaptive": JaxEngine(params, cfg, dataclasses.replace(ecfg, speculative=True, draft_tokens=2,
                                                                      adaptive_draft=True, draft_explore_calls=2))}
    prompts = rb._prompts(cfg, b, prompt_len, seed=b)
    for _ in range(2):   # the adaptive engine's 2 exploring calls decode with every k (the first compiles), then it
      rb.jax_decode(engines["adaptive"], prompts, tokens, 1)   # chooses; later calls run its choice
    best = {name: 0.0 for name in engines}
    for _ in range(repeats):
      for name, e in engines.items():
        tps, stats, _ = rb.jax_decode(e, prompts, tokens, 1)
        best[name] = max(best[name], tps)
        if name == "mtp":
          out[f"mtp_acceptance_b{b}"] = stats.get("accepted", 0) / max(stats.get("drafted", 0), 1)
    out[f"decode_tokens_per_s_b{b}"] = best["plain"]
    out[f"mtp_tokens_per_s_b{b}"] = best["mtp"]
    out[f"mtp_speedup_b{b}"] = best["mtp"] / best["plain"]
    depth = engines["adaptive"].depth
    out[f"adaptive_tokens_per_s_b{b}"] = best["adaptive"]
    out[f"adaptive_speedup_b{b}"] = best["adaptive"] / best["plain"]
    out[f"adaptive_k_b{b}"] = depth.chosen
    out[f"adaptive_tokens_per_forward_b{b}"] = depth.tokens_per_step(depth.chosen or 0)
  return out


def ep_ragged(dry: bool) -> dict:
  """The dropless EP layer on a 1-device mesh vs the dense one-hot reference (same params, routing)."""
  from composer_jax.model import ModelConfig
  from composer_jax.model.expert_parallel import ragged_all_to_all_reference
  from composer_jax.parallel import make_mesh
  eb = _bench_module("ep_bytes")
  cfg = ModelConfig(hidden_size=64 if dry else 1024, n_routed_experts=8 if dry else 64, num_experts_per_tok=2 if dry
                    else 8, moe_intermediate_size=32 if dry else 512, moe_impl="ep_ragged")
  p, x, idx, w, valid = eb.layer_inputs(cfg, 1, 32 if dry else 4096)
  exchange = ragged_all_to_all_reference if dry else jax.lax.ragged_all_to_all
  mesh = make_mesh({"expert": 1}, devices=jax.devices()[:1])
  with jax.default_matmul_precision("highest"):    # GPUs default to TF32 for f32 matmuls: compare exact sums
    return _ep_ragged_compare(cfg, mesh, exchange, dry, p, x, idx, w, valid)


def _ep_ragged_compare(cfg, mesh, exchange, dry, p, x, idx, w, valid) -> dict:
  from composer_jax.model.expert_parallel import expert_parallel
  from composer_jax.model.experts import experts_dense
  ep = jax.jit(lambda *a: expert_parallel(*a, cfg, mesh=mesh, ragged_all_to_all=exchange)[0])(p, x, idx, w, valid)

  D = cfg.hidden_size   # the one-device reference: every expert on every token, one-hot combined
  ref = jax.jit(lambda p, x, i, w: experts_dense(p, x.reshape(-1, D), i.reshape(-1, i.shape[-1]),
                                                w.reshape(-1, w.shape[-1])))(p, x, idx, w).reshape(x.shape)
  err = _rel(ep, ref)
  return {"exchange": "reference all_to_all (--dry)" if dry else "lax.ragged_all_to_all", "max_rel_vs_dense": err,
          "ok": err < 1e-4, "reference_abs_mean": float(jnp.mean(jnp.abs(ref))), "hidden": cfg.hidden_size,
          "experts": cfg.n_routed_experts}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dry", action="store_true", help="CPU: tiny shapes, interpret-mode kernels, no timings of note")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--pretrain_workdir", default=None, help="trained params (with MTP heads) for the decode figures")
  ap.add_argument("--only", nargs="+", default=None,
                  choices=["kernels", "grouped_matmul", "train_small", "decode", "ep_ragged"])
  args = ap.parse_args(argv)
  if not args.dry and jax.default_backend() != "gpu":
    raise SystemExit(f"no GPU (jax backend {jax.default_backend()!r}); run with --dry for the CPU-runnable parts")
  t0 = time.time()
  res = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "dry": args.dry,
         "load_avg": [round(v, 2) for v in os.getloadavg()]}
  sections = {"kernels": lambda: check_kernels(args.dry), "grouped_matmul": lambda: grouped_matmul_speed(args.dry),
              "train_small": lambda: train_small(args.dry, args.steps),
              "decode": lambda: decode(args.dry, args.repeats, args.pretrain_workdir),
              "ep_ragged": lambda: ep_ragged(args.dry)}
  for name, fn in sections.items():
    if args.only and name not in args.only:
      continue
    t = time.time()
    res[name] = fn()
    res[name]["section_s"] = round(time.time() - t, 1)
    print(name, res[name], file=sys.stderr, flush=True)
  res["all_ok"] = all(v.get("ok", True) for s in ("kernels", "ep_ragged") if s in res
                      for v in (res[s].values() if s == "kernels" else [res[s]]) if isinstance(v, dict))
  res["elapsed_s"] = round(time.time() - t0, 1)
  print(json.dumps(res, default=float))
  return res


if __name__ == "__main__":
  main()
