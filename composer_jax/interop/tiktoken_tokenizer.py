"""Kimi K2's tiktoken tokenizer (`tiktoken.model` + tokenizer_config.json) as a `tokenizers` BPE, without remote code.

Kimi K2 ships no tokenizer.json: its `tokenization_kimi.py` (remote code) builds a `tiktoken.Encoding` from
`tiktoken.model` (lines `base64(token bytes) rank`), a split pattern, and 256 special ids after the base vocabulary.
This module rebuilds the same tokenizer from the files alone:
  * merges are recovered from the ranks as transformers' `TikTokenConverter` does: every split of a token into two
    lower-ranked tokens is a merge, at the token's rank (ties by the parts' ranks);
  * the pre-tokenizer is `KIMI_PATTERN` (the `pat_str` of tokenization_kimi.py, verbatim; Oniguruma, the `tokenizers`
    regex engine, supports its class intersections) followed by the byte-level mapping;
  * `ignore_merges`: a pre-token that is itself in the vocabulary is one token, as in tiktoken;
  * ids base .. base + 255 are special: the names tokenizer_config.json's `added_tokens_decoder` gives, and
    `<|reserved_token_{id}|>` for the rest (tokenization_kimi.py's rule).
"""
from __future__ import annotations

import base64
import json
import os

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte → printable character table (what byte-level BPE vocabularies are written in)."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def load_ranks(path: str) -> dict[bytes, int]:
  ranks = {}
  with open(path, "rb") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      parts = line.split()
      if len(parts) != 2:
        raise ValueError(f"{path}:{n}: expected 'base64-token rank', got {line[:80]!r}")
      ranks[base64.b64decode(parts[0])] = int(parts[1])
  return ranks


def from_ranks(ranks: dict[bytes, int], specials: dict[int, str], pattern: str = KIMI_PATTERN) -> tokenizers.Tokenizer:
  """A `tokenizers` BPE equal to `tiktoken.Encoding(pattern, ranks, specials)` (special ids placed by id)."""
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise ValueError("tiktoken ranks must be 0 .. n-1 without gaps")
  enc = bytes_to_unicode()
  text = lambda b: "".join(enc[x] for x in b)
  merges = []
  for token, rank in ranks.items():
    splits = [(ranks[token[:i]], ranks[token[i:]], token[:i], token[i:]) for i in range(1, len(token))
              if token[:i] in ranks and token[i:] in ranks]
    merges += [(rank, a, b, left, right) for a, b, left, right in splits]
  merges.sort()
  bpe = models.BPE({text(t): r for t, r in ranks.items()}, [(text(m[3]), text(m[4])) for m in merges],
                   ignore_merges=True)
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  base = len(ranks)
  if sorted(specials) != list(range(base, base + len(specials))):
    raise ValueError(f"special ids must follow the {base} base tokens without gaps, got {sorted(specials)[:5]}...")
  tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
  return tok


def from_directory(directory: str) -> tokenizers.Tokenizer:
  """The tokenizer of a Kimi K2 checkpoint directory (tiktoken.model + tokenizer_config.json)."""
  ranks = load_ranks(os.path.join(directory, "tiktoken.model"))
  named = {}
  config = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(config):
    with open(config) as f:
      named = {int(i): t["content"] for i, t in json.load(f).get("added_tokens_decoder", {}).items()}
  base = len(ranks)
  return from_ranks(ranks, {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + NUM_RESERVED)})
