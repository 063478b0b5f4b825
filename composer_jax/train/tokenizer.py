"""A byte-level BPE tokenizer trained locally on the corpus, saved so Hugging Face / SGLang load it unchanged.

The special tokens and the chat format come from `rollout.chat_format` (the single source of truth); `CHAT_TEMPLATE`
below is its Jinja twin and tests check that both render identically. `save_tokenizer` writes

  tokenizer.json          the `tokenizers` model (byte-level BPE, GPT-2 pre-tokenizer regex, special tokens first,
                          so <|pad|> is id 0)
  tokenizer_config.json   PreTrainedTokenizerFast class, bos/eos/pad tokens, chat_template, no cleanup of spaces
                          (decode(encode(text)) == text exactly)

so `transformers.AutoTokenizer.from_pretrained(dir)` (and therefore an SGLang server) loads it. eos is <|end_of_turn|>
because this tokenizer serves a chat/agent model; a document in pretraining ends with <|end_of_text|>; both are in
`chat_format.STOP_TOKENS`. No post-processor adds BOS automatically: the data pipeline and the chat format place it.

`load_tokenizer` returns a tokenizer with `encode_special_tokens = True`: plain `encode` of any text (a source file,
tool output) never yields a special id; special ids are placed by id only (see `chat_format.encode_messages`).

A run that starts from a checkpoint directory uses that checkpoint's tokenizer instead of training one
(`from_checkpoint`): its tokenizer.json (DeepSeek-V3's layout, any `tokenizers` model) is kept as it is, the
`chat_format.SPECIAL_TOKENS` it lacks are appended as special tokens (new ids after its last one), and
tokenizer_config.json gets this module's chat template and bos/eos/pad, so SFT, RL, the engines and an SGLang server
all speak `chat_format`. `tokenizer_additions.json` records what was added and replaced. Packing pads with id 0,
which in an adopted tokenizer is its first token rather than <|pad|>: padding is masked, so the id does not matter.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rollout import chat_format as cf

# The Jinja twin of chat_format.render (transformers' `tojson` is json.dumps(x, ensure_ascii=False)).
CHAT_TEMPLATE = (
  "{{- '" + cf.BEGIN_OF_TEXT + "' -}}"
  "{%- for message in messages -%}"
  "{%- set role = message['role'] -%}"
  "{%- if role == 'system' -%}{{- '" + cf.SYSTEM + "' -}}"
  "{%- elif role == 'user' -%}{{- '" + cf.USER + "' -}}"
  "{%- elif role == 'assistant' -%}{{- '" + cf.ASSISTANT + "' -}}"
  "{%- elif role == 'tool' -%}{{- '" + cf.TOOL_RESULT + "' -}}"
  "{%- elif role == 'summary' -%}{{- '" + cf.SUMMARY + "' -}}"
  "{%- else -%}{{- raise_exception('unknown role: ' + role) -}}{%- endif -%}"
  "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
  "{%- if message['tool_calls'] and role != 'assistant' -%}"
  "{{- raise_exception('only assistant messages may have tool_calls') -}}{%- endif -%}"
  "{%- for tool_call in (message['tool_calls'] or []) -%}"
  "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}"
  "{%- set args = call['arguments'] if call['arguments'] is defined else {} -%}"
  "{{- '" + cf.TOOL_CALL + "{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' + "
  "(args if args is string else (args | tojson)) + '}" + cf.TOOL_CALL_END + "' -}}"
  "{%- endfor -%}"
  "{{- '" + cf.END_OF_TURN + "' -}}"
  "{%- endfor -%}"
  "{%- if add_generation_prompt -%}{{- '" + cf.ASSISTANT + "' -}}{%- endif -%}"
)


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  """How to train the BPE.

  Attributes:
    vocab_size: total vocabulary including the 256 byte tokens and the special tokens.
    min_frequency: a pair must occur this often to be merged.
    max_token_length: longest merged token in characters (caps runs of spaces / long identifiers).
    model_max_length: written to tokenizer_config.json (the context length the model is trained for).
  """
  vocab_size: int = 8192
  min_frequency: int = 2
  max_token_length: int = 24
  model_max_length: int = 4096


def _empty_tokenizer() -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  return tok


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig = TokenizerConfig()) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE with `chat_format.SPECIAL_TOKENS` on `texts`.

  Args:
    texts: training documents (e.g. `[d.text for d in corpus.train]`); only the training split, so held-out
      perplexity is not measured on text the merges were fitted to.
    cfg: vocabulary size and merge limits.

  Returns:
    A `tokenizers.Tokenizer` with `encode_special_tokens = True` (plain text never yields special ids).
  """
  min_vocab = 256 + len(cf.SPECIAL_TOKENS)
  if cfg.vocab_size < min_vocab:
    raise ValueError(f"vocab_size={cfg.vocab_size} must be at least {min_vocab} (256 bytes + special tokens)")
  tok = _empty_tokenizer()
  trainer = trainers.BpeTrainer(
    vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=list(cf.SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=cfg.max_token_length,
    show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  got = [tok.token_to_id(t) for t in cf.SPECIAL_TOKENS]
  if got != list(range(len(cf.SPECIAL_TOKENS))):  # The trainer puts them first; pad = 0 is relied on by packing.
    raise RuntimeError(f"special tokens got ids {got}, expected 0..{len(got) - 1}")
  tok.encode_special_tokens = True
  return tok


def tokenizer_config(cfg: TokenizerConfig = TokenizerConfig(), tok: tokenizers.Tokenizer | None = None) -> dict:
  """The tokenizer_config.json contents transformers needs (special tokens and their ids in `tok`, chat template)."""
  ids = [tok.token_to_id(t) for t in cf.SPECIAL_TOKENS] if tok is not None else range(len(cf.SPECIAL_TOKENS))
  added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                    "special": True} for i, t in zip(ids, cf.SPECIAL_TOKENS)}
  return {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": cf.BEGIN_OF_TEXT,
    "eos_token": cf.END_OF_TURN,
    "pad_token": cf.PAD,
    "unk_token": None,
    "additional_special_tokens": [t for t in cf.SPECIAL_TOKENS if t not in (cf.BEGIN_OF_TEXT, cf.END_OF_TURN, cf.PAD)],
    "added_tokens_decoder": added,
    "clean_up_tokenization_spaces": False,
    "add_bos_token": False,
    "add_eos_token": False,
    "model_max_length": cfg.model_max_length,
    "chat_template": CHAT_TEMPLATE,
  }


def save_tokenizer(tok: tokenizers.Tokenizer, directory: str, cfg: TokenizerConfig = TokenizerConfig()) -> None:
  """Writes tokenizer.json and tokenizer_config.json into `directory` (created if missing)."""
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config(cfg, tok), f, indent=2, ensure_ascii=False)


def load_tokenizer(directory: str) -> tokenizers.Tokenizer:
  """Loads tokenizer.json from `directory`, with special-token parsing of plain text disabled."""
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no tokenizer.json in {directory!r}; train one with train_tokenizer + save_tokenizer")
  tok = tokenizers.Tokenizer.from_file(path)
  missing = [t for t in cf.SPECIAL_TOKENS if tok.token_to_id(t) is None]
  if missing:
    raise ValueError(f"tokenizer in {directory!r} lacks special tokens {missing}")
  tok.encode_special_tokens = True
  return tok


def id_space(tok: tokenizers.Tokenizer) -> int:
  """Rows an embedding needs for `tok`: its largest id + 1 (a checkpoint's tokenizer may leave ids unused)."""
  return max(max(tok.get_vocab(with_added_tokens=True).values()) + 1, tok.get_vocab_size())


def padded_vocab_size(tok: tokenizers.Tokenizer, multiple: int = 128) -> int:
  """The model's embedding size: the vocabulary rounded up to `multiple` (for efficient matmuls / sharding)."""
  return -(-id_space(tok) // multiple) * multiple


def check_fits(tok: tokenizers.Tokenizer, vocab_size: int, tokenizer_file: str, vocab_field: str) -> None:
  """Raises, naming the tokenizer file and the model field, when `tok` has ids the model's embedding has no row for
  (an embedding lookup past its last row would silently read another token's row)."""
  n = id_space(tok)
  if n > vocab_size:
    raise ValueError(f"{tokenizer_file} has {n} token ids (the largest {n - 1}), but the model's embedding has "
                     f"{vocab_size} rows ({vocab_field}={vocab_size}): this tokenizer is not the model's, or "
                     f"{vocab_field} is wrong")


ADDITIONS_FILE = "tokenizer_additions.json"


def read_checkpoint_tokenizer(directory: str) -> tuple[tokenizers.Tokenizer, str]:
  """(tokenizer, the file it came from: "tokenizer.json" or "tiktoken.model") of a checkpoint directory."""
  path = os.path.join(directory, "tokenizer.json")
  if os.path.isfile(path):
    return tokenizers.Tokenizer.from_file(path), "tokenizer.json"
  if os.path.isfile(os.path.join(directory, "tiktoken.model")):
    from composer_jax.interop import tiktoken_tokenizer
    return tiktoken_tokenizer.from_directory(directory), "tiktoken.model"
  raise FileNotFoundError(f"no tokenizer.json (nor a Kimi-style tiktoken.model) in {directory!r}")


def from_checkpoint(src: str, dst: str, cfg: TokenizerConfig = TokenizerConfig()) -> tuple[tokenizers.Tokenizer, dict]:
  """Adopts the tokenizer of checkpoint directory `src` into `dst`, adding the chat-format special tokens it lacks.

  Args:
    src: checkpoint directory with tokenizer.json (or a Kimi K2 tiktoken.model + tokenizer_config.json).
    dst: where the adopted tokenizer is written (tokenizer.json, tokenizer_config.json, tokenizer_additions.json).
    cfg: only `model_max_length` is used (written to tokenizer_config.json).

  Returns:
    (tokenizer with `encode_special_tokens = True`, the record also written to `dst/tokenizer_additions.json`:
    source, format, id space before and after, {token: id} added, and the source's replaced config fields).
  """
  tok, fmt = read_checkpoint_tokenizer(src)
  before = id_space(tok)
  missing = [t for t in cf.SPECIAL_TOKENS if tok.token_to_id(t) is None]
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in missing])
  tok.encode_special_tokens = True
  src_config = {}
  if os.path.isfile(os.path.join(src, "tokenizer_config.json")):
    with open(os.path.join(src, "tokenizer_config.json")) as f:
      src_config = json.load(f)
  record = {"source": os.path.abspath(src), "format": fmt, "id_space_before": before, "id_space_after": id_space(tok),
            "added": {t: tok.token_to_id(t) for t in missing},
            "replaced": {k: src_config[k] for k in ("bos_token", "eos_token", "pad_token", "chat_template")
                         if k in src_config}}
  save_tokenizer(tok, dst, cfg)
  with open(os.path.join(dst, ADDITIONS_FILE), "w") as f:
    json.dump(record, f, indent=2, ensure_ascii=False)
  return tok, record
