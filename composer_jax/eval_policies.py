"""Evaluation policies backed by a JAX checkpoint (kept here because `rollout/` never imports JAX).

Two checkpoint layouts are read, both with the tokenizer in `workdir/tokenizer`:
  * an LM-stage workdir (`composer_jax.train.stages`): `params/` (orbax), policy version 0;
  * an RL-run workdir (`composer_jax/rl/weight_files.py`; a finished run ends with its final policy there):
    `weights/latest.json` naming `weights/v<version>.npz`, params flattened by `jax.tree_util.keystr` path; the
    version is reported.
The inference-cost estimate uses the active parameter count of the model config (`count_params`).
"""

from __future__ import annotations

import os

import jax

from composer_jax.model.config import ModelConfig


def load_checkpoint_params(workdir: str, model_cfg: ModelConfig):
  """(params, policy version) from either layout in the module docstring."""
  from composer_jax.model import params as params_lib
  from composer_jax.rl import weight_files
  from composer_jax.train import stages
  if os.path.isdir(os.path.join(workdir, "params")):
    return stages.load_params(workdir, model_cfg), 0
  found = weight_files.latest(os.path.join(workdir, "weights"))
  if found is None:
    raise FileNotFoundError(f"{workdir!r} holds neither an LM-stage export (params/) nor RL weights "
                            "(weights/latest.json)")
  version, path = found
  abstract = params_lib.abstract_params(model_cfg)
  flat = weight_files.load(path, abstract)
  return jax.tree.map(lambda x, like: jax.numpy.asarray(x, like.dtype), flat, abstract), version


def checkpoint_policy(workdir: str, model_cfg: ModelConfig, engine_cfg=None):
  """(engine, tokenizer, active parameters) for a checkpoint workdir, through the embedded JAX engine.

  Args:
    workdir: a stage or RL workdir (see the module docstring).
    model_cfg: the model config the params were trained with.
    engine_cfg: `composer_jax.sampling.engine.EngineConfig` (default when None).
  """
  from composer_jax.model.params import count_params
  from composer_jax.sampling.engine import EngineConfig, JaxEngine
  from composer_jax.train import tokenizer as tokenizer_lib
  tok = tokenizer_lib.load_tokenizer(os.path.join(workdir, "tokenizer"))
  tokenizer_lib.check_fits(tok, model_cfg.vocab_size, os.path.join(workdir, "tokenizer", "tokenizer.json"),
                           "model.vocab_size")
  params, version = load_checkpoint_params(workdir, model_cfg)
  _, active = count_params(model_cfg)
  return JaxEngine(params, model_cfg, engine_cfg or EngineConfig(), policy_version=version), tok, active
