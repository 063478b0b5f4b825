"""composer_jax/train/tokenizer.py: exact round-trips, Hugging Face loading, chat template == chat_format.render."""

import glob
import json
import os
import sysconfig

import pytest

from composer_jax.train import tokenizer as tokenizer_lib
from rollout import chat_format as cf

TRICKY = [
  "",
  "def f(x):\n\treturn x  # tab\n\n\n    \n",
  "    " * 30 + "deeply_indented()\r\n",
  "naïve café — ünïcödé 漢字 🚀🐍 \u200b zero-width, \U0001f9d1\u200d\U0001f4bb ZWJ",
  "s = '<|tool_call|>{\"name\": \"x\"}<|/tool_call|>' <|end_of_turn|> <|pad|>",
  "\x00\x01\x7f binary-ish \ufffd",
  "a" * 500,
]


@pytest.fixture(scope="module")
def tok():
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))
  assert files, "the stdlib json package should be present"
  texts = [open(f, encoding="utf-8").read() for f in files]
  return tokenizer_lib.train_tokenizer(texts, tokenizer_lib.TokenizerConfig(vocab_size=600))


@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("tok"))
  tokenizer_lib.save_tokenizer(tok, directory)
  return directory


def test_vocab_and_specials(tok):
  assert tok.get_vocab_size() == 600
  assert [tok.token_to_id(t) for t in cf.SPECIAL_TOKENS] == list(range(len(cf.SPECIAL_TOKENS)))
  assert tokenizer_lib.padded_vocab_size(tok, 128) == 640


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_exact(tok, text):
  ids = tok.encode(text).ids
  assert tok.decode(ids, skip_special_tokens=False) == text
  assert not set(ids) & set(range(len(cf.SPECIAL_TOKENS))), "plain text must never yield special ids"


def test_round_trip_stdlib_file_and_compression(tok):
  """A file the BPE never saw round-trips and compresses better than bytes (merges were learned)."""
  text = open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py"), encoding="utf-8").read()
  ids = tok.encode(text).ids
  assert tok.decode(ids, skip_special_tokens=False) == text
  assert len(ids) < 0.6 * len(text.encode("utf-8"))


def test_saved_files_and_load(tok, saved):
  with open(os.path.join(saved, "tokenizer_config.json")) as f:
    config = json.load(f)
  assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (cf.BEGIN_OF_TEXT, cf.END_OF_TURN, cf.PAD)
  assert config["chat_template"] == tokenizer_lib.CHAT_TEMPLATE
  loaded = tokenizer_lib.load_tokenizer(saved)
  assert loaded.encode_special_tokens
  for text in TRICKY:
    assert loaded.encode(text).ids == tok.encode(text).ids


def test_load_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    tokenizer_lib.load_tokenizer(str(tmp_path))
  with pytest.raises(ValueError, match="must be at least"):
    tokenizer_lib.train_tokenizer(["x"], tokenizer_lib.TokenizerConfig(vocab_size=100))


MESSAGES = [
  [{"role": "user", "content": "hi"}],
  [
    {"role": "system", "content": "You are an agent.\n"},
    {"role": "user", "content": "Fix naïve 🐍 code\n\tplease"},
    {"role": "assistant", "content": "Reading.", "tool_calls": [
      {"name": "read_file", "arguments": {"path": "ü/a.py", "lines": [1, 2], "opt": None, "deep": {"k": "v"}}}]},
    {"role": "tool", "content": "def f():\n    return 1\n"},
    {"role": "assistant", "content": None, "tool_calls": [
      {"type": "function", "function": {"name": "edit", "arguments": '{"old": "1", "new": "2"}'}},
      {"name": "run", "arguments": {}}]},
    {"role": "tool", "content": ""},
    {"role": "summary", "content": "Edited f."},
    {"role": "assistant", "content": "Done."},
  ],
]


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_autotokenizer_matches(tok, saved, messages, add_generation_prompt):
  """transformers loads the directory unchanged: same ids, same chat template text and ids as chat_format."""
  transformers = pytest.importorskip("transformers", reason="transformers is a test-only reference")
  hf = transformers.AutoTokenizer.from_pretrained(saved)
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (
    tok.token_to_id(cf.BEGIN_OF_TEXT), tok.token_to_id(cf.END_OF_TURN), 0)
  for text in TRICKY:
    # split_special_tokens=True is transformers' spelling of our "plain text never yields special ids".
    assert hf.encode(text, add_special_tokens=False, split_special_tokens=True) == tok.encode(text).ids
    assert hf.decode(tok.encode(text).ids) == text
  rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
  assert rendered == cf.render(messages, add_generation_prompt=add_generation_prompt)
  hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)["input_ids"]
  ours = cf.encode_messages(tok, messages, add_generation_prompt=add_generation_prompt)
  assert list(hf_ids) == ours[0]
  assert cf.encode_messages(hf, messages, add_generation_prompt=add_generation_prompt) == ours  # HF object accepted.
