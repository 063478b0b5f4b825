"""SGLang part of the rollout benchmark (issue 8): decode tokens/s at batch 1 and 16 on CPU, and weight-sync time.

  PYTHONPATH=. python benchmarks/rollout_sglang.py --config=colab [--pretrain_workdir=runs/pretrain_colab]

Serves the model variant's weights (the pretraining run's exported params, else `model.init` with seed 0; MTP heads
dropped, since SGLang's MTP/EAGLE path is GPU-only) through one SGLang server (float32, torch_native attention),
exported with `composer_jax.interop.hf.save` exactly as the RL loop publishes a policy.

Decode tokens/s at batch B = B * (N - 1) / (t(N tokens) - t(1 token)), per row N = `--tokens` greedy tokens after a
`--prompt_len` prompt, all B requests sent at once (the server batches them); median over `--repeats`. Subtracting
the 1-token time removes prefill and HTTP overhead. Weight sync = `hf.save` of new params + the fleet's
pause / `/update_weights_from_disk` / continue.
The last line printed is one JSON object: sglang_decode_tok_s_b1, sglang_decode_tok_s_b16, sglang_weight_sync_s,
sglang_export_s, sglang_update_s, sglang_startup_s, plus the settings.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from composer_jax.interop import hf
from composer_jax.model import ModelConfig, init
from experiments.configs import model as model_configs
from rollout.engines.protocol import GenerateRequest, SamplingParams
from rollout.engines.sglang_fleet import FleetConfig, SGLangFleet
from rollout.engines.sglang_launcher import ServerConfig


def serving_config(variant: str) -> ModelConfig:
  cfg = ModelConfig(**{k: v for k, v in model_configs.get_config(variant).to_dict().items()
                       if k in {f.name for f in dataclasses.fields(ModelConfig)} and k != "rope_scaling"})
  return dataclasses.replace(cfg, num_nextn_predict_layers=0)


def serving_params(cfg: ModelConfig, workdir: str | None, seed: int = 0) -> tuple[dict, str]:
  if workdir:
    from composer_jax.train.stages import load_params
    params, source = load_params(workdir, cfg), "trained"
  else:
    params, source = init(jax.random.key(seed), cfg), "init"
  return {k: v for k, v in params.items() if k != "mtp"}, source


def _time_batch(fleet: SGLangFleet, prompts: np.ndarray, tokens: int) -> float:
  reqs = [GenerateRequest(tuple(int(t) for t in p), SamplingParams(temperature=0, max_tokens=tokens)) for p in prompts]
  t0 = time.perf_counter()
  out = fleet.generate(reqs)
  dt = time.perf_counter() - t0
  assert all(len(r.output_ids) == tokens for r in out)
  return dt


def decode_tok_s(fleet: SGLangFleet, vocab: int, batch: int, prompt_len: int, tokens: int, repeats: int) -> float:
  rates = []
  for rep in range(repeats):
    # Fresh prompts per repeat so the prefix cache never serves a whole prompt.
    prompts = np.random.default_rng(1000 * batch + rep).integers(2, vocab, size=(batch, prompt_len))
    t1 = _time_batch(fleet, prompts, 1)
    prompts = np.random.default_rng(1000 * batch + rep + 500).integers(2, vocab, size=(batch, prompt_len))
    tn = _time_batch(fleet, prompts, tokens)
    rates.append(batch * (tokens - 1) / max(tn - t1, 1e-9))
  return statistics.median(rates)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="colab", help="model variant from experiments/configs/model.py")
  ap.add_argument("--pretrain_workdir", default=None, help="pretraining workdir with exported params")
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--workdir", default=None, help="where checkpoints and server logs go (default: a temp dir)")
  args = ap.parse_args(argv)

  cfg = serving_config(args.config)
  params, source = serving_params(cfg, args.pretrain_workdir)
  root = args.workdir or tempfile.mkdtemp(prefix="rollout_sglang_")
  hf.save(os.path.join(root, "v0"), cfg, params)
  res = {"config": args.config, "weights": source, "tokens": args.tokens, "prompt_len": args.prompt_len,
         "device": "cpu", "dtype": "float32"}
  t0 = time.perf_counter()
  server = ServerConfig(os.path.join(root, "v0"), max_total_tokens=16 * (args.prompt_len + args.tokens) * 2)
  with SGLangFleet(FleetConfig(server), log_dir=os.path.join(root, "logs")) as fleet:
    res["sglang_startup_s"] = round(time.perf_counter() - t0, 2)
    _time_batch(fleet, np.full((1, args.prompt_len), 3), 4)  # warm-up
    for b in (1, 16):
      res[f"sglang_decode_tok_s_b{b}"] = round(decode_tok_s(fleet, cfg.vocab_size, b, args.prompt_len, args.tokens,
                                                            args.repeats), 1)
    new = jax.tree.map(lambda x: x * 1.01, params)
    t0 = time.perf_counter()
    hf.save(os.path.join(root, "v1"), cfg, new)
    res["sglang_export_s"] = round(time.perf_counter() - t0, 3)
    res["sglang_update_s"] = round(fleet.update_weights(os.path.join(root, "v1"), version=1), 3)
    res["sglang_weight_sync_s"] = round(res["sglang_export_s"] + res["sglang_update_s"], 3)
  print(json.dumps(res))
  return res


if __name__ == "__main__":
  main()
