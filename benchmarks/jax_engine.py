"""Rollout-engine benchmark (issue 8): decode throughput, MTP speculative decoding, weight-sync time.

  python benchmarks/jax_engine.py --config=colab --pretrain_workdir=runs/pretrain_colab

Measures, for the embedded JAX engine (composer_jax.sampling):
  * decode tokens/s at batch 1 and 16 (greedy, fixed prompt, every row generates `--tokens` tokens), against
    transformers' `generate` (KV cache on, float32) on the same weights (exported with `composer_jax.interop.hf`);
  * MTP speculative decoding at batch 1 for each `--draft_tokens` k: speedup over plain decoding, draft acceptance
    rate, tokens per step and the cost of a speculative step relative to a plain one, greedy and at temperature 1
    (`mtp_by_k`; the headline `mtp_speedup_b1` / `mtp_acceptance` are greedy at the best k, `*_t1` at T = 1).
    Trained MTP heads come from `--pretrain_workdir` (the pretraining run exports `<workdir>/params`), and the
    prompts are then windows of the pretraining corpus's held-out split (re-read with the colab pretraining
    config's corpus settings and the run's tokenizer); without one the heads are random and the MTP figures are
    reported as such (`mtp_heads: "random"`), not as a result. Plain and speculative runs are interleaved, best of
    `--repeats` each, since this 2-core machine is shared;
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
import tempfile
import time

import jax
import numpy as np

from composer_jax import configs, model
from composer_jax.model.config import ModelConfig
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from experiments.configs import model as model_configs
from rollout.engines.protocol import GenerateRequest, SamplingParams


def model_config(variant: str) -> ModelConfig:
  return configs.from_dict(ModelConfig, model_configs.get_config(variant).to_dict())


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
  return model.init(jax.random.key(0), cfg), "random"


def _prompts(cfg: ModelConfig, batch: int, length: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, length))


def heldout_prompts(workdir: str, n: int, length: int) -> np.ndarray:
  """n windows of `length` tokens from the held-out documents of the colab pretraining corpus."""
  from composer_jax.train import corpus as corpus_lib
  from composer_jax.train import tokenizer as tokenizer_lib
  from experiments.configs import pretrain
  corpus = corpus_lib.load_corpus(configs.from_dict(corpus_lib.CorpusConfig, pretrain.get_config("colab").corpus))
  tok = tokenizer_lib.load_tokenizer(os.path.join(workdir, "tokenizer"))
  out = []
  for doc in corpus.heldout:
    ids = tok.encode(doc.text).ids
    if len(ids) >= 2 * length:  # a window a third of the way in: past the licence header
      out.append(ids[len(ids) // 3:len(ids) // 3 + length])
    if len(out) == n:
      break
  return np.array(out, np.int32)


def mtp_figures(plain: JaxEngine, specs: dict, prompts: np.ndarray, tokens: int, repeats: int,
                temperature: float) -> dict:
  """Batch-1 speculative vs plain decoding over `prompts` (one at a time), runs interleaved, best of `repeats`."""
  engines = {0: plain, **specs}
  best = {k: 0.0 for k in engines}
  stats = {k: {"steps": 0, "drafted": 0, "accepted": 0} for k in engines}
  for i, p in enumerate(prompts):
    reqs = [GenerateRequest(tuple(int(t) for t in p), SamplingParams(temperature=temperature, max_tokens=tokens,
                                                                     seed=i))]
    for e in engines.values():
      e.generate(reqs)  # compile / warm
    times = {k: [] for k in engines}
    for _ in range(repeats):
      for k, e in engines.items():
        t0 = time.perf_counter()
        out = e.generate(reqs)
        times[k].append(time.perf_counter() - t0)
        assert len(out[0].output_ids) == tokens
    for k, e in engines.items():
      best[k] += min(times[k])
      stats[k] = {n: stats[k][n] + e.last_stats.get(n, 0) for n in stats[k]}
  n_tok = tokens * len(prompts)
  res = {}
  for k in specs:
    res[k] = {"speedup": best[0] / best[k], "acceptance": stats[k]["accepted"] / max(stats[k]["drafted"], 1),
              "tokens_per_step": n_tok / stats[k]["steps"],
              # (time per speculative step) / (time per plain step); the speedup is tokens_per_step / this.
              "step_cost_vs_plain": (best[k] / stats[k]["steps"]) / (best[0] / n_tok)}
  return res


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
  params = model.init(jax.random.key(1), cfg)
  new = jax.tree.map(lambda a: a + 0, model.init(jax.random.key(2), cfg))
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
  ap.add_argument("--draft_tokens", default="1,2,3", help="speculative drafts per step to measure (comma list)")
  ap.add_argument("--mtp_prompts", type=int, default=4, help="batch-1 prompts the MTP figures are summed over")
  ap.add_argument("--only_mtp", action="store_true", help="only the MTP speculative decoding figures")
  ap.add_argument("--skip_hf", action="store_true", help="skip the transformers baseline")
  ap.add_argument("--sync_configs", default="colab,small", help="configs to time weight sync for")
  args = ap.parse_args(argv)
  cfg = model_config(args.config)
  params, heads = load_or_random(cfg, args.pretrain_workdir)
  res: dict = {"config": args.config, "mtp_heads": heads, "tokens": args.tokens, "devices": str(jax.devices()[0])}
  # The same prompts are generated again and again: the prefix cache is off so every call decodes as a first call
  # would (multi-turn reuse has its own benchmark, decode_prefix.py).
  ecfg = EngineConfig(min_prompt_bucket=args.prompt_len, min_len_bucket=args.tokens, max_batch=16,
                      prefix_cache_bytes=0)
  plain = JaxEngine(params, cfg, ecfg)
  with tempfile.TemporaryDirectory() as tmp:
    hf_dir = os.path.join(tmp, "hf")
    if not args.skip_hf:
      from composer_jax.interop import hf
      hf.save(hf_dir, cfg, jax.device_get(params))
    for b in () if args.only_mtp else (1, 16):
      prompts = _prompts(cfg, b, args.prompt_len)
      res[f"decode_tokens_per_s_jax_b{b}"], _, jax_toks = jax_decode(plain, prompts, args.tokens, args.repeats)
      if not args.skip_hf:
        res[f"decode_tokens_per_s_hf_b{b}"], hf_toks = hf_decode(hf_dir, prompts, args.tokens, args.repeats)
        # Same weights, same greedy decoding: the tokens should agree (float32 near-ties aside).
        res[f"hf_greedy_token_agreement_b{b}"] = float((hf_toks == jax_toks).mean())
        res[f"decode_speedup_vs_hf_b{b}"] = res[f"decode_tokens_per_s_jax_b{b}"] / res[f"decode_tokens_per_s_hf_b{b}"]
      print({k: v for k, v in res.items() if k.endswith(f"b{b}")}, flush=True)
    if heads == "trained":
      prompts = heldout_prompts(args.pretrain_workdir, args.mtp_prompts, args.prompt_len)
    else:
      prompts = _prompts(cfg, args.mtp_prompts, args.prompt_len, seed=1)
    ks = [int(k) for k in args.draft_tokens.split(",")]
    specs = {k: JaxEngine(params, cfg, dataclasses.replace(ecfg, speculative=True, draft_tokens=k)) for k in ks}
    res["mtp_prompts"] = "heldout" if heads == "trained" else "random"
    res["mtp_by_k"] = {}
    for name, temp in (("greedy", 0.0), ("t1", 1.0)):
      figs = mtp_figures(plain, specs, prompts, args.tokens, args.repeats, temp)
      res["mtp_by_k"][name] = figs
      print(name, figs, flush=True)
    greedy, t1 = res["mtp_by_k"]["greedy"], res["mtp_by_k"]["t1"]
    k_best = max(ks, key=lambda k: greedy[k]["speedup"])
    res["mtp_draft_tokens"] = k_best
    res["mtp_speedup_b1"], res["mtp_acceptance"] = greedy[k_best]["speedup"], greedy[k_best]["acceptance"]
    res["mtp_tokens_per_step"] = greedy[k_best]["tokens_per_step"]
    res["mtp_speedup_b1_t1"], res["mtp_acceptance_t1"] = t1[k_best]["speedup"], t1[k_best]["acceptance"]
    # Greedy speculative decoding must reproduce plain greedy decoding token for token.
    reqs = [GenerateRequest(tuple(int(t) for t in p), SamplingParams(temperature=0.0, max_tokens=args.tokens))
            for p in prompts]
    res["mtp_greedy_equal"] = all(np.array_equal(a.output_ids, b.output_ids)
                                  for a, b in zip(plain.generate(reqs), specs[k_best].generate(reqs)))
    print({k: v for k, v in res.items() if k.startswith("mtp") and k != "mtp_by_k"}, flush=True)
    syncs = {}
    for variant in [] if args.only_mtp else args.sync_configs.split(","):
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
