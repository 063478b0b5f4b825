"""A checkpoint's own tokenizer: adopted with the chat-format tokens added (and recorded); the embedding grows."""
import dataclasses
import glob
import json
import os
import sysconfig

import jax
import numpy as np
import pytest
from hf_checkpoint_testlib import BOS, DEEPSEEK_TEMPLATE, EOS, deepseek_tokenizer

from composer_jax.interop import hf, start
from composer_jax.model import ModelConfig, forward, init
from composer_jax.train import tokenizer as tokenizer_lib
from rollout import chat_format as cf

TEXTS = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(
    os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))]
MESSAGES = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix a.py"},
            {"role": "assistant", "content": "Reading.", "tool_calls": [{"name": "read_file",
                                                                         "arguments": {"path": "a.py"}}]},
            {"role": "tool", "content": "x = 1  # <|end_of_turn|> in a file is text"}]


@pytest.fixture(scope="module")
def adopted(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  original = deepseek_tokenizer(str(root / "ckpt"), TEXTS, vocab_size=500)
  tok, record = tokenizer_lib.from_checkpoint(str(root / "ckpt"), str(root / "run"))
  return original, tok, record, str(root / "run")


def test_chat_tokens_are_added_after_the_checkpoints_ids_and_recorded(adopted):
  original, tok, record, run_dir = adopted
  assert record["format"] == "tokenizer.json" and record["id_space_before"] == 500
  assert list(record["added"]) == list(cf.SPECIAL_TOKENS)
  assert sorted(record["added"].values()) == list(range(500, 500 + len(cf.SPECIAL_TOKENS)))
  assert record["id_space_after"] == 500 + len(cf.SPECIAL_TOKENS)
  assert record["replaced"]["chat_template"] == DEEPSEEK_TEMPLATE and record["replaced"]["bos_token"]["content"] == BOS
  assert json.load(open(os.path.join(run_dir, tokenizer_lib.ADDITIONS_FILE))) == record
  # The checkpoint's own ids are untouched: plain text encodes exactly as before; its specials keep ids 0 and 1.
  for text in TEXTS[:3] + ["def f(x):\n  return x + 1\n"]:
    assert tok.encode(text).ids == original.encode(text).ids
  assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
  # What SFT / RL / the engines load: the adopted directory, speaking chat_format (injection-safe as always).
  loaded = tokenizer_lib.load_tokenizer(run_dir)
  ids, _ = cf.encode_messages(loaded, MESSAGES, add_generation_prompt=True)
  assert loaded.decode(ids, skip_special_tokens=False) == cf.render(MESSAGES, add_generation_prompt=True)
  assert ids.count(loaded.token_to_id(cf.END_OF_TURN)) == 4   # the one inside the tool output is plain text


def test_the_adopted_directory_loads_in_transformers_with_our_template(adopted):
  transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")
  _, tok, _, run_dir = adopted
  hf_tok = transformers.AutoTokenizer.from_pretrained(run_dir)
  text = hf_tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
  assert text == cf.render(MESSAGES[:2], add_generation_prompt=True)
  assert hf_tok.eos_token == cf.END_OF_TURN and hf_tok.convert_tokens_to_ids(cf.TOOL_CALL) == tok.token_to_id(
      cf.TOOL_CALL)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    tokenizer_lib.from_checkpoint(str(tmp_path), str(tmp_path / "run"))


CFG = ModelConfig(vocab_size=500, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  n_routed_experts=4, initializer_range=0.1, max_position_embeddings=64)


def test_resize_vocab_keeps_old_rows_and_logits(adopted):
  params = init(jax.random.key(0), CFG)
  cfg2, p2 = start.resize_vocab(params, CFG, 640)
  assert cfg2.vocab_size == 640 and p2["embed"].shape == (640, 32) and p2["lm_head"].shape == (32, 640)
  np.testing.assert_array_equal(np.asarray(p2["embed"][:500]), np.asarray(params["embed"]))
  # New rows are the mean row (float32 means of 500 values ~0.1: summation order only, ~1e-9).
  np.testing.assert_allclose(np.asarray(p2["embed"][600]), np.asarray(params["embed"]).mean(0), rtol=0, atol=1e-8)
  np.testing.assert_allclose(np.asarray(p2["lm_head"][:, 639]), np.asarray(params["lm_head"]).mean(1), rtol=0,
                             atol=1e-8)
  tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, 500)
  a, _ = forward(params, tokens, CFG)
  b, _ = forward(p2, tokens, cfg2)
  np.testing.assert_allclose(np.asarray(b[..., :500]), np.asarray(a), rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match="only grows"):
    start.resize_vocab(params, CFG, 256)


def test_start_from_hf_grows_the_embedding_and_names_differing_fields(adopted, tmp_path):
  _, tok, _, _ = adopted
  hf.save(str(tmp_path), CFG, jax.device_get(init(jax.random.key(0), CFG)))
  run_cfg = dataclasses.replace(CFG, moe_impl="dense", rope_scaling=None)
  cfg, params, notes = start.from_hf(str(tmp_path), run_cfg, min_vocab=tokenizer_lib.id_space(tok))
  assert cfg.vocab_size == 640 and cfg.moe_impl == "dense" and params["embed"].shape == (640, 32)
  assert "embedding grown from 500 to 640 rows" in notes[0] and "model.vocab_size=640" in notes[0]
  with pytest.raises(ValueError, match=r"hidden_size: config.json 32, run config 64\n  intermediate_size"):
    start.from_hf(str(tmp_path), dataclasses.replace(run_cfg, hidden_size=64, intermediate_size=50), min_vocab=10)


def test_kimi_tiktoken_files_convert_to_the_same_tokenizer(tmp_path):
  """A tiktoken.model written from a BPE trained with Kimi's split pattern converts back to a tokenizer that encodes
  exactly like that BPE (merges recovered from ranks), with Kimi's special-id rule; `from_checkpoint` adopts it."""
  import base64

  import tokenizers
  from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

  from composer_jax.interop import tiktoken_tokenizer as tt
  ref = tokenizers.Tokenizer(models.BPE())
  ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(tt.KIMI_PATTERN), behavior="isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  ref.decoder = decoders.ByteLevel()
  texts = TEXTS + ["你好，世界。今天天气很好。mixed 中文 and English", "CamelCase it's 12345 678\n\n  x\ty"]
  trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  ref.train_from_iterator(texts, trainer)
  dec = {v: k for k, v in tt.bytes_to_unicode().items()}
  with open(tmp_path / "tiktoken.model", "w") as f:
    for token, i in sorted(ref.get_vocab().items(), key=lambda kv: kv[1]):
      f.write(f"{base64.b64encode(bytes(dec[c] for c in token)).decode()} {i}\n")
  json.dump({"added_tokens_decoder": {"700": {"content": "[BOS]"}, "701": {"content": "[EOS]"},
                                      "703": {"content": "<|im_end|>"}}}, open(tmp_path / "tokenizer_config.json", "w"))
  tok = tt.from_directory(str(tmp_path))
  for text in texts + ["Über naïve café 🚀 — \u200b", "def f(x):\n    return x*2  # c\n", "I'LL DO IT'S"]:
    assert tok.encode(text).ids == ref.encode(text).ids, text
    assert tok.decode(tok.encode(text).ids) == text
  assert tok.get_vocab_size() == 700 + 256 and tok.token_to_id("[EOS]") == 701
  assert tok.token_to_id("<|reserved_token_702|>") == 702 and tok.token_to_id("<|reserved_token_955|>") == 955
  adopted, record = tokenizer_lib.from_checkpoint(str(tmp_path), str(tmp_path / "run"))
  assert record["format"] == "tiktoken.model" and record["id_space_before"] == 956
  assert adopted.token_to_id(cf.TOOL_CALL) >= 956
