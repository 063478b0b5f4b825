"""Starting a training stage from a Hugging Face checkpoint directory, as the run configures it.

The checkpoint's config.json fixes the architecture: the run's model config must agree with it (a clear error lists
each field that differs), except for the fields that only say how to run it (`RUN_FIELDS`: MoE implementation,
dtypes, remat, the number of MTP modules to train — missing ones are initialised fresh) and those a stage may change
on purpose (`may_differ`, e.g. RoPE scaling for long-context extension). The params are read sliced onto the run's
mesh, and the embedding (and LM head) grow when the tokenizer needs more ids than the checkpoint has rows: new rows
start at the mean of the existing ones, so a new token's first logits are the average token's.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from composer_jax.interop import hf
from composer_jax.model.config import ModelConfig
from composer_jax.model.params import shardings
from composer_jax.train import tokenizer as tokenizer_lib

RUN_FIELDS = ("moe_impl", "capacity_factor", "moe_matmul", "moe_scale", "attention_impl", "compute_dtype",
              "param_dtype", "scan_layers", "remat", "seq_aux_loss_coef", "initializer_range",
              "num_nextn_predict_layers")
ROPE_FIELDS = ("rope_scaling", "max_position_embeddings")


def _comparable(name: str, value):
  # `hf.save` writes a factor-1 YaRN block when there is no scaling (SGLang's CPU path needs one): plain RoPE.
  if name == "rope_scaling" and value is not None and value.factor == 1.0:
    return None
  return value


def resize_vocab(params: dict, cfg: ModelConfig, vocab_size: int, mesh=None, rules=None) -> tuple[ModelConfig, dict]:
  """Grows the embedding [V, D] (and an untied LM head [D, V]) to `vocab_size`; new rows are the mean row."""
  if vocab_size < cfg.vocab_size:
    raise ValueError(f"resize_vocab only grows the vocabulary ({cfg.vocab_size} → {vocab_size} requested)")
  new_cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
  n = vocab_size - cfg.vocab_size

  def grow(p):
    p = dict(p)
    embed_VxD = p["embed"]
    mean_D = embed_VxD.astype(jnp.float32).mean(0).astype(embed_VxD.dtype)
    p["embed"] = jnp.concatenate([embed_VxD, jnp.broadcast_to(mean_D, (n, mean_D.shape[0]))], axis=0)
    if "lm_head" in p:
      head_DxV = p["lm_head"]
      mean_D = head_DxV.astype(jnp.float32).mean(1).astype(head_DxV.dtype)
      p["lm_head"] = jnp.concatenate([head_DxV, jnp.broadcast_to(mean_D[:, None], (mean_D.shape[0], n))], axis=1)
    return p
  return new_cfg, jax.jit(grow, out_shardings=shardings(new_cfg, mesh, rules))(params)


def from_hf(path: str, model_cfg: ModelConfig, *, min_vocab: int, mesh=None, rules=None,
            may_differ: tuple[str, ...] = ()) -> tuple[ModelConfig, dict, list[str]]:
  """(config, params, notes) to start a stage from checkpoint `path`.

  Args:
    path: a `DeepseekV3ForCausalLM` directory (plain or block-FP8; see `hf.load`).
    model_cfg: the run's model config; `RUN_FIELDS` and `may_differ` are taken from it, the rest must match.
    min_vocab: ids the run's tokenizer uses; the embedding grows (to a multiple of 128) if it has fewer rows.
    mesh, rules: where the params go (each process reads only its devices' blocks).

  Returns:
    The config to train (the run's, with the checkpoint's vocab size or the grown one), the params, and notes on
    what was done (a grown vocabulary).
  """
  keep = RUN_FIELDS + tuple(may_differ)
  cfg, params = hf.load(path, mesh=mesh, rules=rules, **{f: getattr(model_cfg, f) for f in keep})
  if any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tiktoken.model")):
    # The checkpoint's own ids (before the chat-format tokens are added) must have embedding rows: more ids than
    # config.json's vocab_size is another model's tokenizer, which growing the embedding would hide.
    tok, fmt = tokenizer_lib.read_checkpoint_tokenizer(path)
    tokenizer_lib.check_fits(tok, cfg.vocab_size, os.path.join(path, fmt), f"{path}/config.json vocab_size")
  diffs = [f"{f.name}: config.json {getattr(cfg, f.name)!r}, run config {getattr(model_cfg, f.name)!r}"
           for f in dataclasses.fields(ModelConfig)
           if f.name not in keep + ("vocab_size",)
           and _comparable(f.name, getattr(cfg, f.name)) != _comparable(f.name, getattr(model_cfg, f.name))]
  if diffs:
    raise ValueError(f"The Hugging Face checkpoint {path!r} has another architecture than the configured model; set "
                     "these model fields to config.json's values:\n  " + "\n  ".join(diffs))
  notes = []
  if min_vocab > cfg.vocab_size:
    grown = -(-min_vocab // 128) * 128
    notes.append(f"embedding grown from {cfg.vocab_size} to {grown} rows for the tokenizer's {min_vocab} ids "
                 f"(new rows: the mean row); later stages from this one need model.vocab_size={grown}")
    cfg, params = resize_vocab(params, cfg, grown, mesh, rules)
  elif cfg.vocab_size != model_cfg.vocab_size:
    notes.append(f"vocab_size {cfg.vocab_size} from config.json (the run config says {model_cfg.vocab_size}); later "
                 f"stages from this one need model.vocab_size={cfg.vocab_size}")
  return cfg, params, notes
