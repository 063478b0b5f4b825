"""Language-model stages that chain from one another: pretrain → long_context → sft.

Each stage is a `train.loop.train` run in its own workdir, configured by one `StageConfig` nested as
`experiments/configs/pretrain.py` is. A finished stage exports its final params (`workdir/params`, an orbax
PyTree) and keeps its tokenizer (`workdir/tokenizer`); the next stage names that workdir in `init.checkpoint` and
starts from those params with a fresh optimizer, reusing the tokenizer so token ids agree. A Hugging Face
`DeepseekV3ForCausalLM` directory can be the starting point instead (`init.hf`): its params are read sliced onto
the run's mesh, its tokenizer (with the chat-format tokens added) replaces a trained one, and
`workdir/init_hf.json` records what was adapted (see `interop.start`).

The mesh comes from a `MeshConfig`; `data_cfg.batch_size` is the global batch, which a multi-process run splits
between processes (each loads its own shard of the examples). Process 0 prepares the tokenizer; the others wait for it.
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
from composer_jax.parallel import distributed, layout
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.train import corpus as corpus_lib
from composer_jax.train import data as data_lib
from composer_jax.train import loop
from composer_jax.train import tokenizer as tokenizer_lib
from composer_jax.train.config import OptimConfig, TrainConfig

STAGES = ("pretrain", "long_context", "sft")


@dataclasses.dataclass(frozen=True)
class InitConfig:
  """Where a stage starts: a finished earlier stage's workdir, or a Hugging Face DeepseekV3 checkpoint directory."""
  checkpoint: str = ""          # "" (and hf "") = random init
  hf: str = ""


@dataclasses.dataclass(frozen=True)
class SFTDataConfig:
  """The sft stage's transcripts: JSONL of {"messages": [...]}."""
  train_path: str = ""
  eval_path: str = ""


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """One LM stage: which stage, the model, its data and optimisation, the mesh, and where it starts from."""
  model: ModelConfig = ModelConfig()
  stage: str = "pretrain"
  corpus: corpus_lib.CorpusConfig = corpus_lib.CorpusConfig()
  tokenizer: tokenizer_lib.TokenizerConfig = tokenizer_lib.TokenizerConfig()
  data: data_lib.DataConfig = data_lib.DataConfig()
  train: TrainConfig = TrainConfig()
  optim: OptimConfig = OptimConfig()
  mesh: mesh_lib.MeshConfig = mesh_lib.MeshConfig()
  init: InitConfig = InitConfig()
  sft: SFTDataConfig = SFTDataConfig()

  def __post_init__(self):
    if self.stage not in STAGES:
      raise ValueError(f"Unknown stage {self.stage!r}; valid: {STAGES}")
    if self.init.checkpoint and self.init.hf:
      raise ValueError("Set at most one of init.checkpoint and init.hf")
    if self.stage != "pretrain" and not (self.init.checkpoint or self.init.hf):
      raise ValueError(f"Stage {self.stage!r} continues from an earlier stage: set init.checkpoint (a workdir) "
                       "or init.hf (a Hugging Face checkpoint directory)")
    if self.stage == "sft" and not (self.sft.train_path and self.sft.eval_path):
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


def process_data_config(data_cfg: data_lib.DataConfig, batch_sharding) -> data_lib.DataConfig:
  """`data_cfg` (global batch) → this process's share: its shard of the examples and of the batch rows."""
  layout.check_batch_shape(data_cfg.batch_size, data_cfg.seq_len, batch_sharding)
  if data_cfg.shard_count != 1:
    raise ValueError("data.shard_index/shard_count are set by the trainer from the mesh; leave them at 0/1")
  index, count = layout.process_batch_shard(batch_sharding)
  if count == 1:
    return data_cfg
  return dataclasses.replace(data_cfg, batch_size=data_cfg.batch_size // count, shard_index=index, shard_count=count)


def run(cfg: StageConfig, workdir: str, log_fn=print) -> dict:
  """Runs one stage to `cfg.train.steps` (resuming if `workdir` has a checkpoint) and exports its params."""
  mesh, rules = mesh_lib.mesh_from_config(cfg.mesh), cfg.mesh.rules()
  data_cfg = process_data_config(cfg.data, layout.batch_sharding(mesh, rules))
  data = None
  if distributed.is_primary():   # the others wait, then reuse the tokenizer it wrote
    data = _stage_data(cfg, data_cfg, workdir)
    with open(os.path.join(workdir, "data_stats.json"), "w") as f:
      json.dump(data.stats, f, indent=2, default=str)
  distributed.barrier("stage_data")
  if data is None:
    data = _stage_data(cfg, data_cfg, workdir)
  vocab = tokenizer_lib.id_space(data.tokenizer)
  model_cfg = cfg.model
  init_params = None
  if cfg.init.checkpoint:
    init_params = load_params(cfg.init.checkpoint, model_cfg, mesh, rules)
  elif cfg.init.hf:
    from composer_jax.interop import start
    model_cfg, init_params, notes = start.from_hf(
        cfg.init.hf, model_cfg, min_vocab=vocab, mesh=mesh, rules=rules,
        may_differ=start.ROPE_FIELDS if cfg.stage == "long_context" else ())
    for note in notes:
      log_fn(f"init.hf: {note}")
    if distributed.is_primary():
      with open(os.path.join(workdir, "init_hf.json"), "w") as f:
        json.dump({"source": os.path.abspath(cfg.init.hf), "vocab_size": model_cfg.vocab_size,
                   "notes": notes}, f, indent=2)
  if vocab > model_cfg.vocab_size:
    raise ValueError(f"The tokenizer has {vocab} tokens but model.vocab_size is {model_cfg.vocab_size}")
  params, last = loop.train(model_cfg=model_cfg, train_cfg=cfg.train, optim_cfg=cfg.optim, workdir=workdir,
                            train_iter=iter(data.train), eval_batches=lambda: iter(data.eval),
                            init_params=init_params, mesh=mesh, rules=rules, log_fn=log_fn)
  export_params(workdir, params)
  return last


def _stage_data(cfg: StageConfig, data_cfg: data_lib.DataConfig, workdir: str) -> data_lib.Data:
  """The stage's train/eval pipelines; writes the tokenizer into `workdir` first if it has none."""
  os.makedirs(workdir, exist_ok=True)
  tok_dir = _tokenizer_dir(workdir)
  if cfg.init.checkpoint and not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
    shutil.copytree(_tokenizer_dir(cfg.init.checkpoint), tok_dir, dirs_exist_ok=True)
  if cfg.init.hf and not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")) and any(
      os.path.isfile(os.path.join(cfg.init.hf, n)) for n in ("tokenizer.json", "tiktoken.model")):
    _, added = tokenizer_lib.from_checkpoint(cfg.init.hf, tok_dir, cfg.tokenizer)
    print(f"init.hf: tokenizer from {cfg.init.hf} ({added['format']}) with {len(added['added'])} chat-format "
          f"special tokens added, ids {added['id_space_before']} → {added['id_space_after']} (recorded in "
          f"{os.path.join(tok_dir, tokenizer_lib.ADDITIONS_FILE)})")
  if cfg.stage == "sft":
    data = data_lib.sft_data(tokenizer_lib.load_tokenizer(tok_dir), cfg.sft.train_path, cfg.sft.eval_path, data_cfg)
  else:
    data = data_lib.pretrain_data(cfg.corpus, cfg.tokenizer, data_cfg, tok_dir)
  if data.eval is None:
    raise ValueError("The corpus split left no held-out documents; raise corpus.heldout_fraction/min_heldout_files")
  return data
