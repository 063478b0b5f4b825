"""The engine's prefix cache: finished sequences' MLA latent KV rows and routed experts, kept so that a later prompt
starting with the same tokens (a multi-turn continuation: previous prompt + output + tool tokens) prefills only the
tokens after them.

A sequence's rows depend only on its own tokens (causal attention, dropless routing), so an entry serves any prompt
that shares a prefix with it, whatever comes after: lookups take the longest common prefix over all entries, and
never consume an entry, so several continuations can extend one prefix (the next turns of G samples of a group,
or the branches of a tree rollout). An entry that is a prefix of a newer one is dropped when the newer one arrives
(the newer one holds the same rows). Memory is bounded by `max_bytes` in all, least recently used entries evicted
first; an entry costs (layers + MTP modules) · (kv_lora_rank + qk_rope_head_dim) numbers per token, plus its routing
(`rl_colab`: 3 · 40 floats + 4 ints = 496 B; `colab`: 5 · 80 floats + 6 ints = 1.6 KB). Rows are kept in host
memory: on CPU that is the same memory, and on an accelerator the device keeps only the running batch's cache.

Rows are only valid for the weights that computed them: the engine clears its cache on every weight update.

Letters: T tokens of an entry, Ls layers of a stack, C kv_lora_rank, R qk_rope_head_dim, Lm MoE layers, K top-k.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Entry:
  """One cached sequence.

  Attributes:
    tokens: int32 [T], the sequence.
    rows: per cache stack (`cached_model.init_cache`'s names) {"c": [Ls, T, C], "kr": [Ls, T, R]}: the KV rows of
      its tokens at positions 0..T-1.
    experts_TxLmxK: int32, the experts each token was routed to.
    mtp_len: how many leading rows of the "mtp" stack are valid. Module 0's row at position t reads token t+1, so
      rows next to the end (and any computed from rejected drafts) are not; 0 when the engine never ran MTP.
  """
  tokens: np.ndarray
  rows: dict
  experts_TxLmxK: np.ndarray
  mtp_len: int = 0

  def __post_init__(self):
    t = len(self.tokens)
    for name, kv in self.rows.items():
      for key, a in kv.items():
        if a.shape[1] != t:
          raise ValueError(f"prefix entry: rows[{name!r}][{key!r}] hold {a.shape[1]} positions, tokens {t}")
    if self.experts_TxLmxK.shape[0] != t:
      raise ValueError(f"prefix entry: experts for {self.experts_TxLmxK.shape[0]} positions, tokens {t}")

  @property
  def nbytes(self) -> int:
    return (self.tokens.nbytes + self.experts_TxLmxK.nbytes
            + sum(a.nbytes for kv in self.rows.values() for a in kv.values()))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two token arrays."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if diff.size else n


class PrefixCache:
  """Entries keyed by their tokens, at most `max_bytes` in all (LRU eviction)."""

  def __init__(self, max_bytes: int):
    if max_bytes < 0:
      raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
    self.max_bytes = max_bytes
    self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
    self.nbytes = 0

  def __len__(self) -> int:
    return len(self._entries)

  def lookup(self, prompt: np.ndarray) -> tuple[Entry | None, int]:
    """The entry sharing the longest prefix with `prompt` and that length (None, 0 when none shares a token)."""
    best, best_n, best_key = None, 0, None
    for key, e in self._entries.items():
      n = common_prefix(e.tokens, prompt)
      if n > best_n:
        best, best_n, best_key = e, n, key
    if best_key is not None:
      self._entries.move_to_end(best_key)
    return best, best_n

  def insert(self, entry: Entry) -> None:
    """Adds `entry` (replacing one with the same tokens and dropping those it extends), then evicts to the bound."""
    if entry.nbytes > self.max_bytes:
      return
    key = np.asarray(entry.tokens, np.int32).tobytes()
    covered = [k for k, e in self._entries.items()
               if len(e.tokens) <= len(entry.tokens) and e.mtp_len <= entry.mtp_len
               and common_prefix(e.tokens, entry.tokens) == len(e.tokens)]
    if key in self._entries and key not in covered:
      covered.append(key)
    for k in covered:
      self.nbytes -= self._entries.pop(k).nbytes
    self._entries[key] = entry
    self.nbytes += entry.nbytes
    while self.nbytes > self.max_bytes:
      _, old = self._entries.popitem(last=False)
      self.nbytes -= old.nbytes

  def clear(self) -> None:
    self._entries.clear()
    self.nbytes = 0
