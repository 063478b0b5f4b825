"""Rollout-engine benchmark (issue 8): decode throughput, MTP speculative decoding, weight-sync time.

  PYTHONPATH=. python benchmarks/rollout.py --config=colab --pretrain_workdir=runs/pretrain_colab

Measures, for the embedded JAX engine (composer_jax.sampling):
  * decode tokens/s at batch 1 and 16 (greedy, fixed prompt, every row generates `--tokens` tokens), against
    transformers' `generate` (KV cache on, float32) on the same weights (exported with `composer_jax.interop.hf`);
  * MTP speculative decoding at batch 1: speedup over plain decoding and draft acceptance rate, greedy and at
    temperature 1 (`mtp_speedup_b1_t1`, `mtp_acceptance_t1`). Trained MTP heads
    come from `--pretrain_workdir` (the pretraining run exports `<workdir>/params`); without one the heads are
    random and the MTP figures are reported as such (`mtp_heads: "random"`), not as a result;
  * weight sync: the embedded engine's in-place update (`JaxEngine.update_weights`) and the Hugging Face export
    the SGLang fleet loads from, for the colab and small configs.
SGLang decode figures are measured by the SGLang part of this benchmark (rollout/engines); `sglang_hook` below is
where they are merged in, and their keys stay null here when it is not available.
The last line printed is one JSON object (keys: decode_speedup_vs_hf_b1, decode_speedup_vs_hf_b16,
mtp_speedup_b1, mtp_acceptance, weight_sync_s, ...). Expected on a 2-core CPU: see the module README.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

# Run as a script, this file's folder is sys.path[0], and this file's name would shadow the `rollout` package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from composer_jax.model.config import ModelConfig  # noqa: E402
from composer_jax.sampling.engine import EngineConfig, JaxEngine  # noqa: E402
from composer_jax.sampling.random_params import random_params  # noqa: E402
from experiments.configs import model as model_configs  # noqa: E402
from rollout.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402


def model_config(variant: str) -> ModelConfig:
  return ModelConfig.from_dict(model_configs.get_config(variant).to_dict())


def load_or_random(cfg: ModelConfig, workdir: str | None) -> tuple[dict, str]:
  """Trained params from a pretraining workdir, else random ones; returns (params, 'trained' | 'random')."""
  if workdir:
    if not os.path.isdir(os.path.join(workdir, "params")):
      raise SystemExit(f"--pretrain_workdir={workdir!r} has no exported params; run "
                       "experiments/pretrain_main.py --config=experiments/configs/pretrain.py:colab first")
    from composer_jax.train.stages import load_params
    return load_params(workdir, cfg), "trained"
  print("WARNING: no --pretrain_workdir: random weights, so the MTP heads are untrained and the MTP figures below "
        "measure nothing about trained drafts")
  return random_params(cfg, seed=0, std=cfg.initializer_range), "random"


def _prompts(cfg: ModelConfig, batch: int, length: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, length))


def jax_decode(engine: JaxEngine, prompts: np.ndarray, tokens: int, repeats: int, temperature: float = 0.0):
  """(generated tokens per second (best of `repeats`, after a compile run), the engine's last stats, tokens)."""
  reqs = [GenerateRequest(tuple(int(t) for t in p), SamplingParams(temperature=temperature, max_tokens=tokens,
                                                                   seed=i)) for i, p in enumerate(prompts)]
  engine.generate(reqs)  # compile
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    best = min(best, time.perf_counter() - t0)
  assert all(len(r.output_ids) == tokens for r in out)
  return len(reqs) * tokens / best, dict(engine.last_stats), np.stack([r.output_ids for r in out])


def hf_decode(hf_dir: str, prompts: np.ndarray, tokens: int, repeats: int) -> tuple[float, np.ndarray]:
  """transformers `generate` (greedy, KV cache): (tokens per second, best of `repeats` after a warm-up; tokens)."""
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count() or 1)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  ids = torch.tensor(prompts)
  kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, use_cache=True, pad_token_id=0)
  with torch.no_grad():
    hf_model.generate(ids, **kw)
    best = float("inf")
    for _ in range(repeats):
      t0 = time.perf_counter()
      out = hf_model.generate(ids, **kw)
      best = min(best, time.perf_counter() - t0)
  assert out.shape[1] == prompts.shape[1] + tokens
  return prompts.shape[0] * tokens / best, out[:, prompts.shape[1]:].numpy()


def weight_sync(cfg: ModelConfig, out_dir: str) -> dict:
  """Seconds for the embedded engine's in-place update and for the HF export (the SGLang fleet's input)."""
  from composer_jax.interop import hf
  params = random_params(cfg, seed=1, std=cfg.initializer_range)
  new = jax.tree.map(lambda a: a + 0, random_params(cfg, seed=2, std=cfg.initializer_range))
  engine = JaxEngine(params, cfg)
  jax.block_until_ready(new)
  t0 = time.perf_counter()
  engine.update_weights(new, policy_version=1)
  jax.block_until_ready(engine.params)
  update_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  hf.save(out_dir, cfg, jax.device_get(new))
  return {"update_s": update_s, "hf_export_s": time.perf_counter() - t0}


def sglang_hook(args, results: dict) -> None:
  """Where the SGLang engineer's measurement fills decode_tokens_per_s_sglang_b{1,16} (left null here)."""
  del args
  for b in (1, 16):
    results.setdefault(f"decode_tokens_per_s_sglang_b{b}", None)
    results.setdefault(f"decode_speedup_vs_sglang_b{b}", None)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="colab", help="model variant from experiments/configs/model.py")
  ap.add_argument("--pretrain_workdir", default=None, help="pretraining workdir with trained params (MTP heads)")
  ap.add_argument("--tokens", type=int, default=64, help="tokens generated per row")
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--skip_hf", action="store_true", help="skip the transformers baseline")
  ap.add_argument("--sync_configs", default="colab,small", help="configs to time weight sync for")
  args = ap.parse_args(argv)
  cfg = model_config(args.config)
  params, heads = load_or_random(cfg, args.pretrain_workdir)
  res: dict = {"config": args.config, "mtp_heads": heads, "tokens": args.tokens, "devices": str(jax.devices()[0])}
  ecfg = EngineConfig(min_prompt_bucket=args.prompt_len, min_len_bucket=args.tokens, max_batch=16)
  plain = JaxEngine(params, cfg, ecfg)
  spec = JaxEngine(params, cfg, dataclasses.replace(ecfg, speculative=True))
  with tempfile.TemporaryDirectory() as tmp:
    hf_dir = os.path.join(tmp, "hf")
    if not args.skip_hf:
      from composer_jax.interop import hf
      hf.save(hf_dir, cfg, jax.device_get(params))
    for b in (1, 16):
      prompts = _prompts(cfg, b, args.prompt_len)
      res[f"decode_tokens_per_s_jax_b{b}"], _, jax_toks = jax_decode(plain, prompts, args.tokens, args.repeats)
      if not args.skip_hf:
        res[f"decode_tokens_per_s_hf_b{b}"], hf_toks = hf_decode(hf_dir, prompts, args.tokens, args.repeats)
        # Same weights, same greedy decoding: the tokens should agree (float32 near-ties aside).
        res[f"hf_greedy_token_agreement_b{b}"] = float((hf_toks == jax_toks).mean())
        res[f"decode_speedup_vs_hf_b{b}"] = res[f"decode_tokens_per_s_jax_b{b}"] / res[f"decode_tokens_per_s_hf_b{b}"]
      print({k: v for k, v in res.items() if k.endswith(f"b{b}")}, flush=True)
    prompts = _prompts(cfg, 1, args.prompt_len, seed=1)
    spec_tps, stats, spec_toks = jax_decode(spec, prompts, args.tokens, args.repeats)
    plain_tps, _, plain_toks = jax_decode(plain, prompts, args.tokens, args.repeats)
    res["mtp_greedy_equal"] = bool((spec_toks == plain_toks).all())
    res["decode_tokens_per_s_mtp_b1"] = spec_tps
    res["mtp_speedup_b1"] = spec_tps / plain_tps
    res["mtp_acceptance"] = stats["accepted"] / max(stats["drafted"], 1)
    res["mtp_tokens_per_step"] = args.tokens / max(stats["steps"], 1)
    # Sampled at T=1 (as RL rollouts are), where greedy near-degenerate outputs cannot inflate acceptance.
    spec_tps, stats, _ = jax_decode(spec, prompts, args.tokens, args.repeats, temperature=1.0)
    plain_tps, _, _ = jax_decode(plain, prompts, args.tokens, args.repeats, temperature=1.0)
    res["mtp_speedup_b1_t1"] = spec_tps / plain_tps
    res["mtp_acceptance_t1"] = stats["accepted"] / max(stats["drafted"], 1)
    print({k: v for k, v in res.items() if k.startswith("mtp")}, flush=True)
    syncs = {}
    for variant in args.sync_configs.split(","):
      syncs[variant] = weight_sync(model_config(variant), os.path.join(tmp, f"sync_{variant}"))
      print(variant, syncs[variant], flush=True)
    res["weight_sync"] = syncs
    res["weight_sync_s"] = {v: s["update_s"] + s["hf_export_s"] for v, s in syncs.items()}
  sglang_hook(args, res)
  for k in ("decode_speedup_vs_hf_b1", "decode_speedup_vs_hf_b16"):
    res.setdefault(k, None)
  print(json.dumps(res))
  return res


if __name__ == "__main__":
  main()
