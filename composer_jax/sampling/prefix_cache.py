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
  """Entries keyed by their tokens, at most `max_bytes` in all (LRU eviction).

  Every entry's tokens are also rows of one padded matrix (a slot per entry, -1 after its end), so a lookup or an
  insert compares a prompt with all entries in one array operation rather than one `common_prefix` call per entry
  (a 256-task evaluation chunk keeps ~300 entries and looks up or inserts ~1,400 sequences a round)."""

  def __init__(self, max_bytes: int):
    if max_bytes < 0:
      raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
    self.max_bytes = max_bytes
    self.clear()

  def __len__(self) -> int:
    return len(self._entries)

  def clear(self) -> None:
    self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()   # least recently used first
    self.nbytes = 0
    self._slot: dict[bytes, int] = {}
    self._free: list[int] = []
    self._tokens_SxW = np.full((0, 0), -1, np.int32)   # slot -> its entry's tokens, -1 padded (free: all -1)
    self._len_S = np.zeros(0, np.int64)
    self._mtp_S = np.zeros(0, np.int64)
    self._used_S = np.zeros(0, bool)
    self._last_use_S = np.zeros(0, np.int64)            # a clock tick per use: ties go to the least recently used
    self._clock = 0

  def _common_prefixes(self, tokens: np.ndarray) -> np.ndarray:
    """`common_prefix(entry.tokens, tokens)` for every slot (free slots: 0)."""
    n = min(len(tokens), self._tokens_SxW.shape[1])
    if n == 0:
      return np.zeros(len(self._used_S), np.int64)
    eq = self._tokens_SxW[:, :n] == np.asarray(tokens[:n], np.int32)[None]
    return np.where(self._used_S, np.where(eq.all(1), n, eq.argmin(1)), 0)

  def _touch(self, key: bytes) -> None:
    self._entries.move_to_end(key)
    self._clock += 1
    self._last_use_S[self._slot[key]] = self._clock

  def lookup(self, prompt: np.ndarray) -> tuple[Entry | None, int]:
    """The entry sharing the longest prefix with `prompt` and that length (None, 0 when none shares a token)."""
    if not self._entries:
      return None, 0
    n_S = self._common_prefixes(prompt)
    best = int(n_S.max())
    if best == 0:
      return None, 0
    ties = np.flatnonzero(n_S == best)
    slot = int(ties[np.argmin(self._last_use_S[ties])])
    key = self._tokens_SxW[slot, :self._len_S[slot]].tobytes()
    self._touch(key)
    return self._entries[key], best

  def insert(self, entry: Entry) -> None:
    """Adds `entry` (replacing one with the same tokens and dropping those it extends), then evicts to the bound."""
    if entry.nbytes > self.max_bytes:
      return
    tokens = np.asarray(entry.tokens, np.int32)
    key = tokens.tobytes()
    covered_S = self._used_S & (self._len_S <= len(tokens)) & (self._mtp_S <= entry.mtp_len)
    covered_S &= self._common_prefixes(tokens) == self._len_S
    covered = {self._tokens_SxW[s, :self._len_S[s]].tobytes() for s in np.flatnonzero(covered_S)}
    if key in self._entries:
      covered.add(key)
    for k in covered:
      self._remove(k)
    self._add(key, tokens, entry)
    while self.nbytes > self.max_bytes:
      self._remove(next(iter(self._entries)))

  def _add(self, key: bytes, tokens: np.ndarray, entry: Entry) -> None:
    if not self._free:   # twice the slots
      S = len(self._used_S)
      self._free = list(range(max(2 * S, 8) - 1, S - 1, -1))
      grow = len(self._free)
      self._tokens_SxW = np.concatenate([self._tokens_SxW, np.full((grow, self._tokens_SxW.shape[1]), -1, np.int32)])
      self._len_S, self._mtp_S, self._last_use_S = (np.concatenate([a, np.zeros(grow, np.int64)])
                                                    for a in (self._len_S, self._mtp_S, self._last_use_S))
      self._used_S = np.concatenate([self._used_S, np.zeros(grow, bool)])
    if len(tokens) > self._tokens_SxW.shape[1]:   # wider rows: at least twice as wide
      W = max(len(tokens), 2 * self._tokens_SxW.shape[1])
      self._tokens_SxW = np.pad(self._tokens_SxW, ((0, 0), (0, W - self._tokens_SxW.shape[1])), constant_values=-1)
    slot = self._free.pop()
    self._tokens_SxW[slot, :len(tokens)] = tokens
    self._len_S[slot], self._mtp_S[slot], self._used_S[slot] = len(tokens), entry.mtp_len, True
    self._slot[key] = slot
    self._entries[key] = entry
    self.nbytes += entry.nbytes
    self._touch(key)

  def _remove(self, key: bytes) -> None:
    slot = self._slot.pop(key)
    self.nbytes -= self._entries.pop(key).nbytes
    self._tokens_SxW[slot] = -1
    self._used_S[slot] = False
    self._free.append(slot)
