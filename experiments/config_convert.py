"""ConfigDict → frozen dataclasses, once, at the entry point (library code never sees a ConfigDict)."""
from __future__ import annotations

import ml_collections

from composer_jax.model.config import ModelConfig
from composer_jax.parallel.mesh import MeshConfig
from composer_jax.train import config as train_config
from composer_jax.train import corpus as corpus_lib
from composer_jax.train import data as data_lib
from composer_jax.train import stages
from composer_jax.train import tokenizer as tokenizer_lib


def _none_if_negative(x):
  return None if x is not None and x < 0 else x


def stage_kwargs(c: ml_collections.ConfigDict) -> dict:
  """Arguments of `composer_jax.train.stages.run` from a `configs/pretrain.py` config."""
  corpus = c.corpus.to_dict()
  corpus["paths"] = tuple(corpus["paths"])
  corpus["languages"] = tuple(corpus["languages"]) if corpus["languages"] else None
  corpus["max_files"] = _none_if_negative(corpus["max_files"])
  corpus["max_total_bytes"] = _none_if_negative(corpus["max_total_bytes"])
  return dict(
      stage_cfg=stages.StageConfig(stage=c.stage, init_checkpoint=c.init.checkpoint, init_hf=c.init.hf,
                                   sft_train_path=c.sft.train_path, sft_eval_path=c.sft.eval_path),
      model_cfg=ModelConfig.from_dict(c.model.to_dict()),
      mesh_cfg=train_config.from_dict(MeshConfig, c.mesh.to_dict()),
      train_cfg=train_config.from_dict(train_config.TrainConfig, c.train.to_dict()),
      optim_cfg=train_config.from_dict(train_config.OptimConfig, c.optim.to_dict()),
      data_cfg=train_config.from_dict(data_lib.DataConfig, c.data.to_dict()),
      corpus_cfg=train_config.from_dict(corpus_lib.CorpusConfig, corpus),
      tokenizer_cfg=train_config.from_dict(tokenizer_lib.TokenizerConfig,
                                           {**c.tokenizer.to_dict(), "model_max_length": c.data.seq_len}))
