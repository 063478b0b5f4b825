"""The RL starting point: a small tokenizer fitted to procedural training tasks, and SFT on oracle trajectories.

Oracle transcripts are produced by running the scripted oracle through the real harness (same prompts, tool
results and chat format the policy will see), written as JSONL, and trained on with the LM trainer's SFT data path
(loss on assistant tokens only). Held-out tasks never enter the tokenizer or the SFT data.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from composer_jax.model.config import ModelConfig
from composer_jax.train import data as data_lib
from composer_jax.train import loop as train_loop
from composer_jax.train import stages
from composer_jax.train import tokenizer as tokenizer_lib
from composer_jax.train.config import OptimConfig, TrainConfig
from rollout import chat_format, harness
from rollout.engines import scripted


def fit_tokenizer(tasks: Sequence, system_prompt: str, vocab_size: int):
  """A BPE fitted to training-split project files, prompts and oracle transcripts."""
  texts = [f for t in tasks for f in t.environment.files.values()] + [system_prompt, harness.SUMMARY_PROMPT]
  texts += [t.prompt for t in tasks]
  texts += [chat_format.render([{"role": "assistant", **m} for m in t.metadata["oracle"]]) for t in tasks]
  return tokenizer_lib.train_tokenizer(texts, tokenizer_lib.TokenizerConfig(vocab_size=vocab_size))


def oracle_transcripts(tokenizer, tasks: Sequence, envs, hcfg: harness.HarnessConfig) -> list[list[dict]]:
  """The oracle's full transcripts through the harness.

  Raises if the oracle fails a task (a broken grader); tasks marked `near_miss` carry a deliberately wrong
  demonstration and are not checked.
  """
  trajs = harness.run_episodes(scripted.ScriptedEngine(tokenizer, scripted.oracle_policy(tasks)), tokenizer,
                               list(tasks), envs, hcfg)
  bad = [t.task_id for t, task in zip(trajs, tasks, strict=True)
         if not t.metrics.get("solved") and not task.metadata.get("near_miss")]
  if bad:
    raise RuntimeError(f"the oracle failed {len(bad)} tasks (e.g. {bad[:3]}): check the sandbox/grader")
  return [t.messages for t in trajs]


def write_jsonl(path: str, transcripts: Sequence[Sequence[dict]]) -> None:
  with open(path, "w") as f:
    for m in transcripts:
      f.write(json.dumps({"messages": list(m)}) + "\n")


def run_sft(model_cfg: ModelConfig, tokenizer, train: Sequence, heldout: Sequence, workdir: str, *, steps: int,
            seq_len: int, batch_size: int, learning_rate: float, seed: int = 0, init_params=None,
            log_fn: Callable[[str], None] = print):
  """SFT on transcripts in `workdir` (resumable); exports `workdir/params` and returns the params and last metrics."""
  os.makedirs(workdir, exist_ok=True)
  tokenizer_lib.save_tokenizer(tokenizer, os.path.join(workdir, "tokenizer"))
  tr, ev = os.path.join(workdir, "sft_train.jsonl"), os.path.join(workdir, "sft_eval.jsonl")
  write_jsonl(tr, train)
  write_jsonl(ev, heldout)
  dcfg = data_lib.DataConfig(seq_len=seq_len, batch_size=batch_size, seed=seed)
  data = data_lib.sft_data(tokenizer, tr, ev, dcfg)
  tcfg = TrainConfig(steps=steps, seed=seed, log_every=max(1, steps // 10), eval_every=steps, eval_batches=2,
                     ckpt_every=steps, ckpt_keep=1, mtp_loss="none", mtp_weight=0.0, bias_update_rate=1e-3,
                     progress_bar=False)
  ocfg = OptimConfig(learning_rate=learning_rate, warmup_steps=max(1, steps // 10), decay_steps=steps)
  params, last = train_loop.train(model_cfg=model_cfg, train_cfg=tcfg, optim_cfg=ocfg, workdir=workdir,
                                  train_iter=iter(data.train), eval_batches=lambda: iter(data.eval),
                                  init_params=init_params, log_fn=log_fn)
  stages.export_params(workdir, params)
  return params, last
