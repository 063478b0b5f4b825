r"""Training-step throughput: our jitted step vs transformers' DeepseekV3ForCausalLM on CPU torch.

  python benchmarks/train_step.py [--variant colab] [--batch 8] [--seq 256] [--steps 5]

Same model (our params exported with `composer_jax.interop.hf.save` and loaded by transformers), same batch, same
work per step: forward + backward + AdamW (MTP off on both sides — transformers does not train MTP heads). Model
FLOPs utilisation is against the matmul peak measured in the same run (`jnp.dot` of two 2048² float32 matrices).
Last line: JSON with `tokens_per_s`, `speedup_vs_torch`, `mfu_vs_matmul_peak`.
"""
import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from composer_jax import (
  configs,  # noqa: E402
  model,  # noqa: E402
)
from composer_jax.interop import hf  # noqa: E402
from composer_jax.train import loop, optim, step  # noqa: E402
from composer_jax.train.config import OptimConfig, TrainConfig  # noqa: E402
from experiments.configs import model as model_configs  # noqa: E402


def matmul_peak_flops(n=2048, reps=10) -> float:
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  t = time.perf_counter()
  for _ in range(reps):
    out = f(a, a)
  out.block_until_ready()
  return 2 * n**3 * reps / (time.perf_counter() - t)


def model_flops_per_step(cfg, B, L) -> float:
  """6 · active weights · tokens + causal attention scores/values (3 × forward)."""
  _, active = model.count_params(cfg)
  attn_fwd = 2 * B * cfg.num_hidden_layers * cfg.num_attention_heads * L * L * (cfg.qk_head_dim + cfg.v_head_dim) / 2
  return 6 * active * B * L + 3 * attn_fwd


def time_ours(cfg, params, batch, steps):
  """The step exactly as the trainer builds it (`train.loop`): explicit shardings, state donated."""
  opt = optim.make_optimizer(OptimConfig(), params)
  mesh = loop.single_device_mesh()
  p_shard = model.shardings(cfg, mesh)
  shardings = step.state_shardings(opt, jax.eval_shape(lambda: params), p_shard)
  state = jax.jit(lambda p: step.init_state(p, opt), out_shardings=shardings)(params)
  batch_sharding = NamedSharding(mesh, P("data"))
  batch = jax.device_put(batch, batch_sharding)
  fn = step.make_train_step(cfg, TrainConfig(mtp_loss="none"), opt, shardings, batch_sharding)
  t = time.perf_counter()
  state, m = fn(state, batch)
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t
  t = time.perf_counter()
  for _ in range(steps):
    state, m = fn(state, batch)
  jax.block_until_ready(m)
  return (time.perf_counter() - t) / steps, compile_s


def time_torch(path, tokens, steps):
  import torch
  from transformers import DeepseekV3ForCausalLM
  torch.set_num_threads(os.cpu_count() or 1)
  m = DeepseekV3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
  m.train()
  opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
  ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)

  def one():
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
  one()                                                        # warm-up (allocations, lazy init)
  t = time.perf_counter()
  for _ in range(steps):
    one()
  return (time.perf_counter() - t) / steps


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="colab")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--moe_impl", default=None, help="override the config's MoE path (dense | ragged | capacity)")
  args = ap.parse_args()
  d = model_configs.get_config(args.variant).to_dict()
  d["num_nextn_predict_layers"] = 0
  if args.moe_impl:
    d["moe_impl"] = args.moe_impl
  cfg = configs.from_dict(model.ModelConfig, d)
  B, L = args.batch, args.seq
  params = model.init(jax.random.key(0), cfg)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (B, L)).astype(np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones((B, L), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
           "loss_mask": jnp.ones((B, L), jnp.float32)}
  peak = matmul_peak_flops()
  with tempfile.TemporaryDirectory() as tmp:
    hf.save(tmp, cfg, jax.device_get(params))
    ours_s, compile_s = time_ours(cfg, params, batch, args.steps)
    torch_s = time_torch(tmp, tokens, args.steps)
  flops = model_flops_per_step(cfg, B, L)
  result = {
      "config": dataclasses.asdict(cfg) | {"batch": B, "seq": L},
      "load_average": os.getloadavg()[0],
      "step_s": ours_s, "compile_s": compile_s, "torch_step_s": torch_s,
      "matmul_peak_gflops": peak / 1e9, "model_gflops_per_step": flops / 1e9,
      "tokens_per_s": B * L / ours_s, "torch_tokens_per_s": B * L / torch_s,
      "speedup_vs_torch": torch_s / ours_s, "mfu_vs_matmul_peak": flops / ours_s / peak,
  }
  for k, v in result.items():
    if k != "config":
      print(f"{k:>22}: {v:.4g}" if isinstance(v, float) else f"{k:>22}: {v}")
  print(json.dumps({k: result[k] for k in ("tokens_per_s", "speedup_vs_torch", "mfu_vs_matmul_peak",
                                            "torch_tokens_per_s", "step_s", "load_average")}))


if __name__ == "__main__":
  main()
