"""Evaluation policies backed by a JAX checkpoint (kept here because `rollout/` never imports JAX).

Two checkpoint layouts are read, both with the tokenizer in `workdir/tokenizer`:
  * an LM-stage workdir (`composer_jax.train.stages`): `params/` (orbax), policy version 0;
  * an RL-run workdir (branch `rlloop`, `composer_jax/rl/publish.py`): `weights/latest.json` naming
    `weights/v<version>.npz`, params flattened by `jax.tree_util.keystr` path; the version is reported.
The inference-cost estimate uses the active parameter count of the model config (`count_params`).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from composer_jax.model.config import ModelConfig


def load_checkpoint_params(workdir: str, model_cfg: ModelConfig):
  """(params, policy version) from either layout in the module docstring."""
  from composer_jax.model import params as params_lib
  from composer_jax.train import stages
  if os.path.isdir(os.path.join(workdir, "params")):
    return stages.load_params(workdir, model_cfg), 0
  ptr = os.path.join(workdir, "weights", "latest.json")
  if not os.path.exists(ptr):
    raise FileNotFoundError(f"{workdir!r} holds neither an LM-stage export (params/) nor RL weights "
                            "(weights/latest.json)")
  with open(ptr) as f:
    latest = json.load(f)
  path = os.path.join(workdir, "weights", latest["path"])
  with np.load(path) as z:
    flat = dict(z)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params_lib.abstract_params(model_cfg))
  out = []
  for p, like in leaves:
    k = jax.tree_util.keystr(p)
    if k not in flat:
      raise ValueError(f"{path} has no leaf {k}; was it published from a different model config?")
    if flat[k].shape != tuple(like.shape):
      raise ValueError(f"{path}: leaf {k} has shape {flat[k].shape}, expected {tuple(like.shape)}")
    out.append(jax.numpy.asarray(flat[k], like.dtype))
  return jax.tree_util.tree_unflatten(treedef, out), int(latest["version"])


def checkpoint_policy(workdir: str, model_cfg: ModelConfig, engine_cfg=None):
  """(engine, tokenizer, active parameters) for a checkpoint workdir, through the embedded JAX engine.

  Args:
    workdir: a stage or RL workdir (see the module docstring).
    model_cfg: the model config the params were trained with.
    engine_cfg: `composer_jax.sampling.engine.EngineConfig` (default when None).
  """
  try:
    from composer_jax.sampling.engine import EngineConfig, JaxEngine
  except ImportError as e:
    raise ImportError("the embedded JAX engine (composer_jax.sampling, branch `engine`) is not available; "
                      f"merge it to evaluate checkpoints ({e})") from None
  from composer_jax.model.params import count_params
  from composer_jax.train import tokenizer as tokenizer_lib
  tok = tokenizer_lib.load_tokenizer(os.path.join(workdir, "tokenizer"))
  if tok.get_vocab_size() > model_cfg.vocab_size:
    raise ValueError(f"tokenizer in {workdir} has {tok.get_vocab_size()} tokens > model vocab_size "
                     f"{model_cfg.vocab_size}; wrong model config for this checkpoint?")
  params, version = load_checkpoint_params(workdir, model_cfg)
  _, active = count_params(model_cfg)
  return JaxEngine(params, model_cfg, engine_cfg or EngineConfig(), policy_version=version), tok, active
