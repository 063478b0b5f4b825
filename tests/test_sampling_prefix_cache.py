"""`PrefixCache` bookkeeping: longest-common-prefix lookup, covered entries dropped, LRU eviction to the bound."""
import numpy as np
import pytest

from composer_jax.sampling.prefix_cache import Entry, PrefixCache, common_prefix

PER_TOKEN = 52   # bytes: the token (4), c 2 x 3 and kr 2 x 1 float32 (32), 2 x 2 int32 experts (16)


def _entry(tokens, mtp_len=0):
  t = np.asarray(tokens, np.int32)
  rows = {"moe_layers": {"c": np.full((2, len(t), 3), float(len(t)), np.float32),
                         "kr": np.zeros((2, len(t), 1), np.float32)}}
  return Entry(t, rows, np.zeros((len(t), 2, 2), np.int32), mtp_len)


def test_common_prefix():
  a = np.array([1, 2, 3, 4])
  assert common_prefix(a, np.array([1, 2, 9])) == 2
  assert common_prefix(a, np.array([1, 2])) == 2
  assert common_prefix(a, a) == 4
  assert common_prefix(a, np.array([7])) == 0


def test_lookup_takes_the_longest_common_prefix_and_shares_entries():
  cache = PrefixCache(100 * PER_TOKEN)
  cache.insert(_entry([1, 2, 3, 4, 5]))
  cache.insert(_entry([1, 2, 8]))
  e, n = cache.lookup(np.array([1, 2, 3, 4, 5, 6, 7]))   # a continuation
  assert n == 5 and list(e.tokens) == [1, 2, 3, 4, 5]
  e2, n2 = cache.lookup(np.array([1, 2, 3, 9]))          # a branch off the same prefix: the same entry serves it
  assert n2 == 3 and e2 is e
  assert cache.lookup(np.array([1, 2, 8, 8]))[1] == 3
  assert cache.lookup(np.array([5, 1])) == (None, 0)
  assert len(cache) == 2 and cache.nbytes == 8 * PER_TOKEN


def test_an_extending_entry_replaces_the_entries_it_covers():
  cache = PrefixCache(100 * PER_TOKEN)
  cache.insert(_entry([1, 2, 3]))
  cache.insert(_entry([1, 2]))            # older entries are never dropped for a shorter one
  assert len(cache) == 2
  cache.insert(_entry([1, 2, 3, 4]))      # covers both
  assert len(cache) == 1 and cache.nbytes == 4 * PER_TOKEN
  cache.insert(_entry([1, 2, 3, 4, 5], mtp_len=0))
  cache.insert(_entry([1, 2, 3, 4, 5, 6], mtp_len=0))
  assert len(cache) == 1
  # An entry whose MTP rows reach further than the newer one's is kept: the newer one cannot serve them.
  cache.insert(_entry([7, 8, 9], mtp_len=2))
  cache.insert(_entry([7, 8, 9, 10], mtp_len=1))
  assert len(cache) == 3
  cache.insert(_entry([7, 8, 9], mtp_len=0))   # the same tokens again replace the entry, counted once
  assert len(cache) == 3 and cache.nbytes == 13 * PER_TOKEN


def test_eviction_keeps_the_bound_and_drops_the_least_recently_used():
  cache = PrefixCache(10 * PER_TOKEN)
  cache.insert(_entry([1, 1, 1, 1]))
  cache.insert(_entry([2, 2, 2, 2]))
  cache.lookup(np.array([1, 1]))           # touches the first entry
  cache.insert(_entry([3, 3, 3, 3]))       # 12 > 10: the least recently used ([2, ...]) goes
  assert cache.nbytes == 8 * PER_TOKEN <= cache.max_bytes
  assert cache.lookup(np.array([2]))[1] == 0 and cache.lookup(np.array([1]))[1] == 1
  cache.insert(_entry(list(range(11))))    # longer than the whole cache: not kept, nothing evicted for it
  assert cache.nbytes == 8 * PER_TOKEN and len(cache) == 2
  cache.clear()
  assert cache.nbytes == 0 and len(cache) == 0 and cache.lookup(np.array([3]))[1] == 0


def test_bad_entries_and_sizes_raise():
  with pytest.raises(ValueError, match="positions"):
    Entry(np.zeros(3, np.int32), {"moe_layers": {"c": np.zeros((1, 2, 4))}}, np.zeros((3, 1, 1), np.int32))
  with pytest.raises(ValueError, match="experts"):
    Entry(np.zeros(3, np.int32), {}, np.zeros((2, 1, 1), np.int32))
  with pytest.raises(ValueError, match=">= 0"):
    PrefixCache(-1)


class _Reference:
  """The cache as a plain loop over its entries (one `common_prefix` per entry): what `PrefixCache` computes with
  its token matrix."""

  def __init__(self, max_bytes):
    self.max_bytes, self.entries, self.nbytes = max_bytes, {}, 0

  def lookup(self, prompt):
    best, best_n = None, 0
    for key, e in self.entries.items():   # least recently used first: a tie goes to it
      n = common_prefix(e.tokens, prompt)
      if n > best_n:
        best, best_n = key, n
    if best is None:
      return None, 0
    self.entries[best] = self.entries.pop(best)
    return self.entries[best], best_n

  def insert(self, entry):
    if entry.nbytes > self.max_bytes:
      return
    key = entry.tokens.tobytes()
    for k in [k for k, e in self.entries.items() if k == key or (
        len(e.tokens) <= len(entry.tokens) and e.mtp_len <= entry.mtp_len
        and common_prefix(e.tokens, entry.tokens) == len(e.tokens))]:
      self.nbytes -= self.entries.pop(k).nbytes
    self.entries[key] = entry
    self.nbytes += entry.nbytes
    while self.nbytes > self.max_bytes:
      self.nbytes -= self.entries.pop(next(iter(self.entries))).nbytes


def test_matches_the_loop_over_entries_on_random_episodes():
  """Branching multi-turn sequences over a small vocabulary (many shared prefixes and ties), inserted and looked up
  in random order under a bound that evicts: every lookup, size and byte count as the plain loop's."""
  rng = np.random.default_rng(0)
  fast, ref = PrefixCache(400 * PER_TOKEN), _Reference(400 * PER_TOKEN)
  seqs = [list(rng.integers(0, 3, size=rng.integers(1, 6)))]
  for _ in range(600):
    base = seqs[rng.integers(len(seqs))]
    seq = base[:rng.integers(0, len(base) + 1)] + list(rng.integers(0, 3, size=rng.integers(0, 8)))
    if not seq:
      continue
    seqs.append(seq)
    if rng.random() < 0.5:
      e = _entry(seq, mtp_len=int(rng.integers(0, 3)))
      fast.insert(e)
      ref.insert(e)
    else:
      (a, n), (b, m) = fast.lookup(np.asarray(seq)), ref.lookup(np.asarray(seq))
      assert n == m and (a is b), seq
    assert len(fast) == len(ref.entries) and fast.nbytes == ref.nbytes
  assert len(fast) > 20
