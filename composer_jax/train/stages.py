"""Language-model stages that chain from one another: pretrain → long_context → sft.

Each stage is a `train.loop.train` run in its own workdir. A finished stage exports its final params
(`workdir/params`, an orbax PyTree) and keeps its tokenizer (`workdir/tokenizer`); the next stage names that workdir
in `init.checkpoint` and starts from those params with a fresh optimizer, reusing the tokenizer so token ids agree.
A Hugging Face `DeepseekV3ForCausalLM` directory can be the starting point instead (`init.hf`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import orbax.checkpoint as ocp

from composer_jax import model
from composer_jax.model.config import ModelConfig
from composer_jax.train import corpus as corpus_lib
from composer_jax.train import data as data_lib
from composer_jax.train import loop
from composer_jax.train import tokenizer as tokenizer_lib
from composer_jax.train.config import OptimConfig, TrainConfig

STAGES = ("pretrain", "long_context", "sft")


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """Which stage, where it starts from and (for SFT) which transcripts it trains on."""
  stage: str = "pretrain"
  init_checkpoint: str = ""     # workdir of a finished earlier stage ("" = random init)
  init_hf: str = ""             # or a Hugging Face DeepseekV3 checkpoint directory
  sft_train_path: str = ""      # JSONL of {"messages": [...]} (sft stage)
  sft_eval_path: str = ""

  def __post_init__(self):
    if self.stage not in STAGES:
      raise ValueError(f"Unknown stage {self.stage!r}; valid: {STAGES}")
    if self.init_checkpoint and self.init_hf:
      raise ValueError("Set at most one of init.checkpoint and init.hf")
    if self.stage != "pretrain" and not (self.init_checkpoint or self.init_hf):
      raise ValueError(f"Stage {self.stage!r} continues from an earlier stage: set init.checkpoint (a workdir) "
                       "or init.hf (a Hugging Face checkpoint directory)")
    if self.stage == "sft" and not (self.sft_train_path and self.sft_eval_path):
      raise ValueError("The sft stage needs sft.train_path and sft.eval_path (JSONL transcripts)")


def export_params(workdir: str, params) -> str:
  path = os.path.join(os.path.abspath(workdir), "params")
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, params, force=True)
  ckptr.wait_until_finished()
  return path


def load_params(workdir: str, model_cfg: ModelConfig, mesh=None, rules=None):
  """Final params of a finished stage, restored onto this stage's shardings (the shapes must agree)."""
  path = os.path.join(os.path.abspath(workdir), "params")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{workdir!r} has no exported params ({path}); did that stage finish?")
  abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), model_cfg))
  shardings = model.shardings(model_cfg, mesh or loop.single_device_mesh(), rules)
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
  return ocp.StandardCheckpointer().restore(path, target)


def _tokenizer_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "tokenizer")


def run(*, stage_cfg: StageConfig, model_cfg: ModelConfig, train_cfg: TrainConfig, optim_cfg: OptimConfig,
        data_cfg: data_lib.DataConfig, corpus_cfg: corpus_lib.CorpusConfig,
        tokenizer_cfg: tokenizer_lib.TokenizerConfig, workdir: str, log_fn=print) -> dict:
  """Runs one stage to `train_cfg.steps` (resuming if `workdir` has a checkpoint) and exports its params."""
  os.makedirs(workdir, exist_ok=True)
  tok_dir = _tokenizer_dir(workdir)
  if stage_cfg.init_checkpoint and not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
    shutil.copytree(_tokenizer_dir(stage_cfg.init_checkpoint), tok_dir, dirs_exist_ok=True)
  if stage_cfg.init_hf and not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
    if os.path.isfile(os.path.join(stage_cfg.init_hf, "tokenizer.json")):
      os.makedirs(tok_dir, exist_ok=True)
      for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(stage_cfg.init_hf, name), tok_dir)
  if stage_cfg.stage == "sft":
    data = data_lib.sft_data(tokenizer_lib.load_tokenizer(tok_dir), stage_cfg.sft_train_path,
                             stage_cfg.sft_eval_path, data_cfg)
  else:
    data = data_lib.pretrain_data(corpus_cfg, tokenizer_cfg, data_cfg, tok_dir)
  if data.eval is None:
    raise ValueError("The corpus split left no held-out documents; raise corpus.heldout_fraction/min_heldout_files")
  vocab = data.tokenizer.get_vocab_size()
  if vocab > model_cfg.vocab_size:
    raise ValueError(f"The tokenizer has {vocab} tokens but model.vocab_size is {model_cfg.vocab_size}")
  with open(os.path.join(workdir, "data_stats.json"), "w") as f:
    json.dump(data.stats, f, indent=2, default=str)

  init_params = None
  if stage_cfg.init_checkpoint:
    init_params = load_params(stage_cfg.init_checkpoint, model_cfg)
  elif stage_cfg.init_hf:
    from composer_jax.interop import hf
    hf_cfg, init_params = hf.load(stage_cfg.init_hf)
    _check_same_shapes(hf_cfg, model_cfg)
  params, last = loop.train(model_cfg=model_cfg, train_cfg=train_cfg, optim_cfg=optim_cfg, workdir=workdir,
                    train_iter=iter(data.train), eval_batches=lambda: iter(data.eval), init_params=init_params,
                    log_fn=log_fn)
  export_params(workdir, params)
  return last


def _check_same_shapes(a: ModelConfig, b: ModelConfig) -> None:
  sa = jax.eval_shape(lambda: model.init(jax.random.key(0), a))
  sb = jax.eval_shape(lambda: model.init(jax.random.key(0), b))
  if jax.tree.structure(sa) != jax.tree.structure(sb) or any(
      x.shape != y.shape for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb))):
    raise ValueError("The Hugging Face checkpoint's shapes differ from the configured model; set the model config "
                     "to the checkpoint's config.json")
