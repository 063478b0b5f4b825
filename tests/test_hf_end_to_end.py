"""Done-when of starting from a real checkpoint: a directory written by transformers' `save_pretrained` with its
default config (one MTP module declared, none written) and a DeepSeek-V3-style tokenizer runs through
`pretrain_main --config.init.hf=<dir>`, an SFT stage and `rl_main`, on the tiny config, as three user commands.
Slow: ~120-170 s under load (three processes, each compiling its model).
"""
import glob
import json
import os
import subprocess
import sys
import sysconfig

import pytest
from hf_checkpoint_testlib import deepseek_tokenizer

from composer_jax.train import tokenizer as tokenizer_lib
from rollout import chat_format as cf

torch = pytest.importorskip("torch", reason="torch is the test-only reference implementation")
transformers = pytest.importorskip("transformers", reason="transformers writes the checkpoint")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # a user's environment: one CPU device
# The tiny config's shape; everything else is DeepseekV3Config's default (num_nextn_predict_layers=1 among them).
HF_SHAPE = dict(vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1)
# Every override of the three commands, in one place. The tokenizer has 500 ids + 19 chat tokens > 512 rows, so the
# embedding grows to 640: the later stages say so (`init_hf.json` tells the user).
PRETRAIN = ["--config.corpus.max_total_bytes=200000", "--config.data.seq_len=64", "--config.data.batch_size=2",
            "--config.train.steps=2", "--config.train.log_every=1", "--config.train.eval_every=100",
            "--config.train.eval_batches=1", "--config.train.ckpt_every=2", "--config.train.progress_bar=False"]
SFT = ["--config.model.vocab_size=640", "--config.data.seq_len=256", "--config.data.batch_size=2",
       "--config.train.steps=2", "--config.train.eval_every=100", "--config.train.eval_batches=1",
       "--config.train.ckpt_every=2", "--config.train.progress_bar=False"]
RL = ["--config.model.vocab_size=640", "--config.model.num_nextn_predict_layers=1",
      "--config.model.max_position_embeddings=4096", "--config.sft.steps=0", "--config.rl.steps=1",
      "--config.eval.tasks=2"]
TRANSCRIPT = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix add in a.py"},
              {"role": "assistant", "content": "Reading it.", "tool_calls": [{"name": "read_file",
                                                                             "arguments": {"path": "a.py"}}]},
              {"role": "tool", "content": "def add(a, b):\n    return a - b\n"},
              {"role": "assistant", "content": "The sign is wrong; fixed."}]


def _run(args):
  r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
  assert r.returncode == 0, r.stderr[-4000:]
  return r


@pytest.mark.slow
def test_save_pretrained_checkpoint_through_pretrain_sft_and_rl(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  torch.manual_seed(0)
  transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_SHAPE)).save_pretrained(ckpt)
  texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(
      os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))]
  deepseek_tokenizer(ckpt, texts, vocab_size=500)
  pre, sft, rl = tmp_path / "pre", tmp_path / "sft", tmp_path / "rl"

  r = _run(["experiments/pretrain_main.py", "--config=experiments/configs/pretrain.py:tiny", f"--workdir={pre}",
            f"--config.init.hf={ckpt}", *PRETRAIN])
  assert "no tensors for MTP module(s) 0" in r.stderr and "Initialised them fresh" in r.stderr
  added = json.load(open(pre / "tokenizer" / "tokenizer_additions.json"))
  assert added["id_space_before"] == 500 and list(added["added"]) == list(cf.SPECIAL_TOKENS)
  record = json.load(open(pre / "init_hf.json"))
  assert record["vocab_size"] == 640 and "embedding grown from 512 to 640" in record["notes"][0]

  for name in ("train", "eval"):
    with open(tmp_path / f"{name}.jsonl", "w") as f:
      f.writelines(json.dumps({"messages": TRANSCRIPT}) + "\n" for _ in range(8))
  _run(["experiments/pretrain_main.py", "--config=experiments/configs/pretrain.py:tiny,stage=sft", f"--workdir={sft}",
        f"--config.init.checkpoint={pre}", f"--config.sft.train_path={tmp_path / 'train.jsonl'}",
        f"--config.sft.eval_path={tmp_path / 'eval.jsonl'}", *SFT])
  assert json.load(open(sft / "tokenizer" / "tokenizer_additions.json")) == added   # the same ids all the way

  r = _run(["experiments/rl_main.py", "--config=experiments/configs/rl.py:test,mode=sync", f"--workdir={rl}",
            f"--config.sft.init_checkpoint={sft}", *RL])
  result = json.loads(r.stdout.strip().splitlines()[-1])
  assert result, r.stdout[-2000:]
  phases = result["phase_seconds"]   # every phase that ran, timed, and within the whole
  assert {"sft_start", "rl", "eval_sft", "eval_rl", "total"} <= set(phases) and all(v >= 0 for v in phases.values())
  assert phases["total"] >= phases["rl"] + phases["eval_rl"]
  rl_tok = tokenizer_lib.load_tokenizer(str(rl / "tokenizer"))   # RL re-saves the tokenizer it was given
  assert {t: rl_tok.token_to_id(t) for t in added["added"]} == added["added"] and rl_tok.get_vocab_size() == 519
  rows = [json.loads(line) for line in open(rl / "metrics.jsonl")]
  assert any(row.get("step") == 1 for row in rows)
