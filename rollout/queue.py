"""The trajectory queue: rollout workers append groups, the trainer consumes each exactly once, on any kvstore.

Storage is a tensorstore KvStore (`file:///path/`, `memory://`, and for several machines `gs://bucket/path/`,
`s3://bucket/path/` or an S3-compatible server's JSON spec; see `open_store`). Keys:

  groups/<producer>/<t_ns:020d>_v<version>_n<rows>   one group (see `queue_codec`: arrays + JSON, checksummed)
  committed.json                                     the last cursor a trainer checkpoint has made durable
  counters/<producer>.json                           what a producer did not queue (`QueueProducer.count`: groups
                                                     retried or dropped whole), summed into the consumer's `stats()`

Guarantees and how they are met:
- Atomic visibility: a group is one key written in one `write` (the file driver writes `<key>.__lock` and renames;
  object stores publish a PUT whole), so a producer killed mid-write leaves nothing listable. The blob's CRC makes
  any other corruption an error rather than bad data. An unreadable record (corrupt, truncated, or from a newer
  codec version) is skipped, counted (`corrupt`, `newer_format`) and named in the log; it never stops the consumer.
- Order: each producer appends sequentially (`append` returns only once the key is visible) with strictly
  increasing key names, so a per-producer cursor "last key consumed" is exact. Producers must have stable, unique
  ids (e.g. `host3-worker7`); several threads in one process should use several ids.
- Exactly once across trainer crashes: the consumer's position (`QueueConsumer.state()`, a small JSON dict) is
  saved *inside the trainer checkpoint*. Restoring it re-delivers exactly the groups consumed after that checkpoint
  (the trainer never applied them) and none before. Garbage collection (`commit`) deletes only keys at or before
  the cursor of a checkpoint that has been *saved* (wait for orbax's async save to finish), so nothing a restore
  might need is gone. If you may restore from an older checkpoint than the newest, commit that older one's state.
- A restarted producer resumes after its newest key, listed or recorded in `committed.json`, so its new keys
  always sort after everything the trainer already consumed.

One consumer (the trainer's host) per queue. Staleness (`staleness.StalenessConfig`) is decided from the version in
the key name, so dropping a stale group costs no read.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import json
import re
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorstore as ts

from rollout import queue_codec, tree_codec
from rollout import tree as tree_lib
from rollout.staleness import StalenessConfig

GROUPS = "groups/"
COMMITTED = "committed.json"
COUNTERS = "counters/"
SKIPPED_KEPT = 20   # the consumer state names this many of the most recent unreadable records
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_NAME_RE = re.compile(r"^(\d{20})_v(-?\d+)_n(\d+)$")


class QueueWriteError(OSError):
  """A group could not be written (e.g. the disk is full); nothing of it is listed, the queue stays readable."""


def is_disk_full(error: BaseException) -> bool:
  """Whether `error` (an OSError, or tensorstore's ValueError carrying the OS error) says the device is full."""
  return getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error)


def open_store(store: str | dict | ts.KvStore, context: ts.Context | None = None) -> ts.KvStore:
  """Opens a kvstore from a URL (`file:///tmp/q/`, `memory://`, `gs://b/p/`), a JSON spec (a dict, or a string
  starting with `{`: what a config flag can carry), or passes an open one through.

  An S3-compatible store other than AWS needs the spec form, for its endpoint:
  `{"driver": "s3", "bucket": "b", "path": "q/", "endpoint": "http://10.0.0.5:9000", "aws_region": "us-east-1"}`
  (credentials from the usual AWS_* environment variables or ~/.aws files).
  `memory://` stores are private to the opened object: share the returned KvStore between producer and consumer.
  """
  if isinstance(store, ts.KvStore):
    return store
  if isinstance(store, str) and store.lstrip().startswith("{"):
    try:
      store = json.loads(store)
    except json.JSONDecodeError as e:
      raise ValueError(f"queue store {store!r} starts with '{{' but is not a JSON kvstore spec: {e}") from None
  if isinstance(store, str) and not store.endswith("/") and not store.endswith("://"):
    store = store + "/"   # keys are appended to the path: make it a directory
  kw = {} if context is None else {"context": context}
  return ts.KvStore.open(store, **kw).result()


@dataclasses.dataclass(frozen=True)
class GroupKey:
  """A parsed group key."""
  producer: str
  t_ns: int
  version: int
  n_rows: int

  @property
  def name(self) -> str:
    return f"{self.t_ns:020d}_v{self.version}_n{self.n_rows}"

  @property
  def key(self) -> str:
    return f"{GROUPS}{self.producer}/{self.name}"

  @staticmethod
  def parse(key: str) -> GroupKey | None:
    """None for keys that are not group keys (e.g. foreign files in the directory)."""
    parts = key[len(GROUPS):].split("/") if key.startswith(GROUPS) else []
    m = _NAME_RE.match(parts[1]) if len(parts) == 2 else None
    if m is None:
      return None
    return GroupKey(parts[0], int(m.group(1)), int(m.group(2)), int(m.group(3)))


def _list_groups(kv: ts.KvStore, producer: str | None = None) -> list[GroupKey]:
  prefix = GROUPS if producer is None else f"{GROUPS}{producer}/"
  keys = kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord("/") + 1))).result()
  out = [GroupKey.parse(k.decode()) for k in keys]
  return sorted((g for g in out if g is not None), key=lambda g: (g.t_ns, g.producer))


def _read_committed(kv: ts.KvStore) -> dict[str, str]:
  r = kv.read(COMMITTED).result()
  return json.loads(r.value) if r.state == "value" else {}


def _read_json(kv: ts.KvStore, key: str) -> dict:
  r = kv.read(key).result()
  return json.loads(r.value) if r.state == "value" else {}


def read_counters(kv: ts.KvStore) -> dict[str, int]:
  """Every producer's `count`s, summed by name."""
  keys = kv.list(ts.KvStore.KeyRange(COUNTERS, COUNTERS[:-1] + chr(ord("/") + 1))).result()
  total: dict[str, int] = collections.Counter()
  for k in keys:
    total.update(_read_json(kv, k.decode()))
  return dict(total)


def group_version(tree: Any) -> int:
  """Oldest policy version (≥ 0) among arrays named `versions_T` in a group tree; -1 if there is none."""
  arrays, _ = queue_codec.pack_tree(tree)
  found = [a[a >= 0] for name, a in arrays.items() if name.endswith("versions_T")]
  found = [a for a in found if a.size]
  return int(min(a.min() for a in found)) if found else -1


class QueueProducer:
  """Appends groups under one producer id. Not for concurrent use by several threads (use several ids)."""

  def __init__(self, store: str | dict | ts.KvStore, producer_id: str):
    if not _ID_RE.match(producer_id):
      raise ValueError(f"producer_id {producer_id!r} must match {_ID_RE.pattern} (no '/')")
    self.kv = open_store(store)
    self.producer_id = producer_id
    self._lock = threading.Lock()
    # Resume strictly after anything this id ever wrote: listed keys, or the committed cursor if GC removed them.
    last = [g.t_ns for g in _list_groups(self.kv, producer_id)]
    committed = _read_committed(self.kv).get(producer_id)
    if committed is not None:
      last.append(GroupKey.parse(f"{GROUPS}{producer_id}/{committed}").t_ns)
    self._last_t = max(last, default=0)
    self._counts = collections.Counter(_read_json(self.kv, f"{COUNTERS}{producer_id}.json"))

  def count(self, name: str, n: int = 1) -> None:
    """Adds `n` to this producer's counter `name` (e.g. a group dropped whole), which the consumer's `stats()` sums
    over producers: what never reached the queue still shows in the trainer's metrics."""
    with self._lock:
      self._counts[name] += n
      self.kv.write(f"{COUNTERS}{self.producer_id}.json", json.dumps(self._counts, sort_keys=True).encode()).result()

  def append(self, arrays: dict[str, np.ndarray], meta: Any = None, *, policy_version: int, n_rows: int = 1) -> str:
    """Writes one group and returns its key once it is visible to consumers.

    Args:
      arrays: named numpy arrays (int arrays that fit are stored as uint8, see `queue_codec`).
      meta: JSON-serialisable metadata.
      policy_version: the oldest policy version that generated any token of the group (drives staleness).
      n_rows: how many training rows the group will become (lets the consumer fill fixed-size batches
        without reading blobs).
    """
    if policy_version < 0 or n_rows < 1:
      raise ValueError(f"need policy_version >= 0 and n_rows >= 1, got {policy_version=} {n_rows=}")
    blob = queue_codec.encode(arrays, meta)
    with self._lock:
      t = max(time.time_ns(), self._last_t + 1)
      key = GroupKey(self.producer_id, t, policy_version, n_rows).key
      try:
        self.kv.write(key, blob).result()
      except (ValueError, OSError) as e:   # tensorstore reports I/O errors as ValueError
        full = is_disk_full(e)
        raise QueueWriteError(errno.ENOSPC if full else errno.EIO,
                              f"queue group {key} ({len(blob)} bytes) was not written"
                              f"{': the disk is full' if full else ''}; nothing of it is listed and the queue stays "
                              f"readable (a worker redoes the group when it restarts): {e}") from e
      self._last_t = t
    return key

  def append_group(self, trajectories: list[dict], *, policy_version: int | None = None, **meta) -> str:
    """Appends a group of trajectory dicts (`Trajectory.to_dict()`); one training row per segment.

    The policy version defaults to the oldest in the group's `versions_T` arrays. Extra keyword arguments
    are stored as group metadata (e.g. task_id, group_id, timings).
    """
    trajectories = [t.to_dict() if hasattr(t, "to_dict") else t for t in trajectories]
    if not trajectories:
      raise ValueError("a group needs at least one trajectory")
    tree = {"trajectories": trajectories, "meta": meta}
    if policy_version is None:
      policy_version = group_version(trajectories)
      if policy_version < 0:
        raise ValueError("no versions_T >= 0 in the group; pass policy_version explicitly")
    n_rows = (len(tree_lib.group_rows(trajectories)) if tree_lib.is_tree_group(trajectories)  # shared rows once
              else sum(len(t.get("segments", [None])) for t in trajectories))
    tree["trajectories"] = tree_codec.share_prefixes(trajectories)   # a tree group's shared prefixes once
    arrays, skeleton = queue_codec.pack_tree(tree)
    return self.append(arrays, skeleton, policy_version=policy_version, n_rows=n_rows)


@dataclasses.dataclass
class ConsumedGroup:
  """A delivered group: its key, staleness at delivery and decoded content."""
  key: GroupKey
  staleness: int
  over_stale: bool            # beyond max_staleness, delivered because the policy is 'keep'
  arrays: dict[str, np.ndarray]
  meta: Any

  def tree(self) -> Any:
    """The nest given to `append_group`/`pack_tree` (arrays back in place)."""
    return queue_codec.unpack_tree(self.arrays, self.meta)

  def trajectories(self) -> list[dict]:
    return tree_codec.restore_prefixes(self.tree()["trajectories"])


def _empty_state() -> dict:
  return {"cursor": {}, "consumed": 0, "consumed_rows": 0, "dropped_stale": 0, "kept_stale": 0, "corrupt": 0,
          "newer_format": 0, "skipped": [], "staleness_hist": {}}


class QueueConsumer:
  """The trainer's side: delivers groups in FIFO order, each once, within the staleness policy.

  Usage (`state()` goes into the trainer checkpoint):

    consumer = QueueConsumer(url, StalenessConfig(2, "drop"), state=restored_or_None)
    groups = consumer.poll(trainer_version=v, max_rows=batch_rows)
    ... train on groups; at a checkpoint: save consumer.state() with the params, wait for the save,
    then consumer.commit(that_state) to garbage-collect.
  """

  def __init__(self, store: str | dict | ts.KvStore, staleness: StalenessConfig | None = None,
               state: dict | None = None):
    self.kv = open_store(store)
    self.staleness = staleness if staleness is not None else StalenessConfig()
    base = _empty_state()
    if state is not None:
      unknown = set(state) - set(base)
      if unknown:
        raise ValueError(f"unknown consumer state keys {sorted(unknown)}; valid: {sorted(base)}")
      base.update(json.loads(json.dumps(state)))   # deep copy, and ints/strs as JSON gives them back
    self._state = base

  def state(self) -> dict:
    """The consumer position and counters: small, JSON-serialisable; save it in the trainer checkpoint."""
    return json.loads(json.dumps(self._state))

  def _pending(self) -> list[GroupKey]:
    cur = self._state["cursor"]
    return [g for g in _list_groups(self.kv) if g.name > cur.get(g.producer, "")]

  def depth(self) -> tuple[int, int]:
    """(groups, rows) visible and not yet consumed or dropped."""
    pending = self._pending()
    return len(pending), sum(g.n_rows for g in pending)

  def poll(self, trainer_version: int, *, max_groups: int | None = None, max_rows: int | None = None,
           batch_rows: int | None = None,
           fits: Callable[[ConsumedGroup], bool] | None = None) -> list[ConsumedGroup]:
    """Delivers the oldest pending groups (possibly none), advancing the cursor past them and past dropped ones.

    Args:
      trainer_version: the policy version the trainer is at (staleness = trainer_version − group version).
      max_groups: deliver at most this many.
      max_rows: deliver whole groups while their rows sum to at most this (what is left of a fixed-size batch); a
        group that does not fit waits for the next poll.
      batch_rows: the whole batch's rows (default max_rows): a group larger than it can never be batched, an error.
      fits: called with each group about to be delivered (decoded, after the checks above); False: it does not fit
        (e.g. its tokens do not pack into what is left of the batch) and waits for the next poll, like max_rows.
    """
    out, rows = [], 0
    st = self._state
    for g in self._pending():
      if max_groups is not None and len(out) >= max_groups:
        break
      decision = self.staleness.decide(trainer_version, g.version)
      if decision == "drop":
        st["dropped_stale"] += 1
        st["cursor"][g.producer] = g.name
        continue
      if max_rows is not None:
        capacity = max_rows if batch_rows is None else batch_rows
        if g.n_rows > capacity:
          raise ValueError(f"group {g.key} has {g.n_rows} rows, more than the batch's {capacity}: it can never "
                           "be batched; raise the batch size (rl.rows_per_step) or shorten groups")
        if rows + g.n_rows > max_rows:
          break
      r = self.kv.read(g.key).result()
      try:
        if r.state != "value":
          raise queue_codec.CorruptRecordError(f"listed key {g.key} vanished")
        arrays, meta = queue_codec.decode(r.value)
      except queue_codec.UnreadableRecordError as e:
        self._skip(g, e)
        continue
      s = trainer_version - g.version
      group = ConsumedGroup(g, s, decision == "keep_stale", arrays, meta)
      if fits is not None and not fits(group):
        break
      st["cursor"][g.producer] = g.name
      st["consumed"] += 1
      st["consumed_rows"] += g.n_rows
      st["kept_stale"] += decision == "keep_stale"
      st["staleness_hist"][str(s)] = st["staleness_hist"].get(str(s), 0) + 1
      rows += g.n_rows
      out.append(group)
    return out

  def _skip(self, g: GroupKey, error: queue_codec.UnreadableRecordError) -> None:
    """Steps over an unreadable record: counted by kind, named in the log and in the state's `skipped` list."""
    st = self._state
    kind = "newer_format" if isinstance(error, queue_codec.NewerFormatError) else "corrupt"
    st[kind] += 1
    st["skipped"] = (st["skipped"] + [{"key": g.key, "reason": str(error)}])[-SKIPPED_KEPT:]
    st["cursor"][g.producer] = g.name
    warnings.warn(f"skipping unreadable queue record {g.key} ({kind}): {error}", stacklevel=3)

  def stats(self) -> dict[str, Any]:
    """Queue-side metrics: depth, totals, dropped/kept stale counts, unreadable records skipped, the producers'
    counters (`QueueProducer.count`) and the staleness histogram of consumed groups."""
    groups, rows = self.depth()
    st = self._state
    hist = collections.OrderedDict(sorted(((int(k), v) for k, v in st["staleness_hist"].items())))
    return {**read_counters(self.kv), "queue_depth_groups": groups, "queue_depth_rows": rows,
            "consumed_groups": st["consumed"], "consumed_rows": st["consumed_rows"],
            "dropped_stale": st["dropped_stale"], "kept_stale": st["kept_stale"], "corrupt": st["corrupt"],
            "newer_format": st["newer_format"], "staleness_hist": dict(hist)}

  def commit(self, saved_state: dict) -> int:
    """Garbage-collects every group at or before `saved_state`'s cursor; returns how many keys were deleted.

    Call it only with the state stored in a checkpoint whose save has *finished*. It records the cursor in
    `committed.json` first (so restarted producers keep their keys ordered after it), then deletes.
    """
    cursor = saved_state["cursor"]
    committed = _read_committed(self.kv)
    for p, name in cursor.items():
      committed[p] = max(committed.get(p, ""), name)
    self.kv.write(COMMITTED, json.dumps(committed, sort_keys=True).encode()).result()
    n = sum(g.name <= cursor.get(g.producer, "") for g in _list_groups(self.kv))
    for p, name in cursor.items():   # one range delete per producer: [groups/p/, groups/p/<name>]
      self.kv.delete_range(ts.KvStore.KeyRange(f"{GROUPS}{p}/", f"{GROUPS}{p}/{name}\x00")).result()
    return n
