"""Evaluation policies backed by a JAX checkpoint (kept here because `rollout/` never imports JAX).

A checkpoint is an LM-stage workdir as `composer_jax.train.stages` exports it: `params/` (orbax) and `tokenizer/`.
Its inference-cost estimate uses the active parameter count of its model config (`count_params`).
"""

from __future__ import annotations

import os

from composer_jax.model.config import ModelConfig


def checkpoint_policy(workdir: str, model_cfg: ModelConfig, policy_version: int = 0, engine_cfg=None):
  """(engine, tokenizer, active parameters) for a checkpoint workdir, through the embedded JAX engine.

  Args:
    workdir: stage workdir with `params/` and `tokenizer/tokenizer.json`.
    model_cfg: the model config the params were trained with.
    policy_version: reported with every result.
    engine_cfg: `composer_jax.sampling.engine.EngineConfig` (default when None).
  """
  try:
    from composer_jax.sampling.engine import EngineConfig, JaxEngine
  except ImportError as e:
    raise ImportError("the embedded JAX engine (composer_jax.sampling, branch `engine`) is not available; "
                      f"merge it to evaluate checkpoints ({e})") from None
  from composer_jax.model.params import count_params
  from composer_jax.train import stages
  from composer_jax.train import tokenizer as tokenizer_lib
  tok = tokenizer_lib.load_tokenizer(os.path.join(workdir, "tokenizer"))
  if tok.get_vocab_size() > model_cfg.vocab_size:
    raise ValueError(f"tokenizer in {workdir} has {tok.get_vocab_size()} tokens > model vocab_size "
                     f"{model_cfg.vocab_size}; wrong model config for this checkpoint?")
  params = stages.load_params(workdir, model_cfg)
  _, active = count_params(model_cfg)
  return JaxEngine(params, model_cfg, engine_cfg or EngineConfig(), policy_version=policy_version), tok, active
