"""Trajectory queue in one process: codec, FIFO/exactly-once bookkeeping, GC, producer restart, staleness, batching.

Every queue test runs on the memory, file and S3 kvstores (S3: a real moto server on 127.0.0.1, `s3_testlib`).
The crash tests with real SIGKILLs are in test_queue_crash.py.
"""
import numpy as np
import pytest
from s3_testlib import BACKENDS, queue_store, s3_endpoint  # noqa: F401  (s3_endpoint: a fixture)

from rollout import queue as queue_lib
from rollout import queue_codec
from rollout.queue import GroupKey, QueueConsumer, QueueProducer, group_version, open_store
from rollout.staleness import StalenessConfig


def _traj(n_tokens, version, reward, n_segments=1, E=8):
  rng = np.random.default_rng(n_tokens + version)
  segs = []
  for _ in range(n_segments):
    routed = rng.integers(0, E, (n_tokens, 2, 2)).astype(np.int32)
    routed[:3] = -1                                          # prompt tokens: not recorded
    segs.append({"tokens_T": rng.integers(0, 1000, n_tokens).astype(np.int32),
                 "gen_mask_T": (np.arange(n_tokens) >= 3).astype(np.int8),
                 "logprobs_T": rng.normal(size=n_tokens).astype(np.float32),
                 "versions_T": np.where(np.arange(n_tokens) >= 3, version, -1).astype(np.int32),
                 "routed_TxNxK": routed, "prompt_len": 3, "turns": [{"tools": ["grep"]}]})
  return {"task_id": "t", "segments": segs, "reward": reward, "breakdown": {"task": reward}}


def _assert_tree_equal(a, b):
  if isinstance(a, np.ndarray):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)
  elif isinstance(a, dict):
    assert set(a) == set(b)
    for k in a:
      _assert_tree_equal(a[k], b[k])
  elif isinstance(a, (list, tuple)):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
      _assert_tree_equal(x, y)
  else:
    assert a == b


class TestCodec:

  def test_round_trip_and_compaction(self):
    routed = np.full((6, 3, 2), -1, np.int32)
    routed[2:] = np.arange(4 * 3 * 2).reshape(4, 3, 2) + 232       # values up to 255: E = 256 still fits uint8
    arrays = {"routed": routed, "big": np.array([1, 300], np.int32), "partial": np.array([[0, -1], [1, 2]]),
              "f": np.linspace(0, 1, 5, dtype=np.float32), "b": np.array([True, False]),
              "empty": np.zeros((0, 4), np.int64)}
    blob = queue_codec.encode(arrays, {"x": [1, 2]})
    out, meta = queue_codec.decode(blob)
    assert meta == {"x": [1, 2]}
    _assert_tree_equal(arrays, out)
    # The routing column is stored as one byte per expert id (+ a 1-bit row mask), not four.
    big = np.tile(routed, (100, 1, 1))
    plain = queue_codec.encode({"routed": big}, compact=False)
    small = queue_codec.encode({"routed": big})
    assert len(plain) - len(small) >= big.size * 3 - 200        # 200: header and mask bytes
    _assert_tree_equal({"routed": big}, queue_codec.decode(small)[0])

  @pytest.mark.parametrize("damage", ["truncate", "flip", "magic"])
  def test_corruption_is_detected(self, damage):
    blob = bytearray(queue_codec.encode({"a": np.arange(100)}, {"m": 1}))
    if damage == "truncate":
      blob = blob[:len(blob) // 2]
    elif damage == "flip":
      blob[len(blob) // 2] ^= 0x10
    else:
      blob[:4] = b"XXXX"
    with pytest.raises(queue_codec.CorruptRecordError):
      queue_codec.decode(bytes(blob))

  def test_bad_input_errors(self):
    with pytest.raises(TypeError, match="dtype object"):
      queue_codec.encode({"o": np.array([{}, 1], dtype=object)})
    with pytest.raises(TypeError, match="JSON"):
      queue_codec.encode({}, {"x": object()})

  def test_pack_tree_round_trip(self):
    tree = {"trajectories": [_traj(9, 4, 1.0, n_segments=2), _traj(7, 5, 0.0)], "meta": {"group": "g1"}}
    arrays, skel = queue_codec.pack_tree(tree)
    out = queue_codec.unpack_tree(*queue_codec.decode(queue_codec.encode(arrays, skel)))
    _assert_tree_equal(tree, out)
    assert group_version(tree) == 4


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
  """(KvStore, string spec another process could open or None) on each backend."""
  return queue_store(request.param, tmp_path, request)


class TestQueue:

  def test_fifo_exactly_once_restore_and_gc(self, store):
    kv, _ = store
    a, b = QueueProducer(kv, "a"), QueueProducer(kv, "b")
    keys = []
    for i in range(6):
      keys.append((a if i % 2 == 0 else b).append({"i": np.array([i])}, {"i": i}, policy_version=0))
    c = QueueConsumer(kv)
    assert c.depth() == (6, 6)
    got = [g.meta["i"] for g in c.poll(0, max_groups=2)]
    assert got == [0, 1]                                   # FIFO across producers
    saved = c.state()                                      # "checkpoint" after 2 groups
    got += [g.meta["i"] for g in c.poll(0, max_groups=3)]
    assert got == [0, 1, 2, 3, 4]
    # Crash + restore from the checkpoint: groups 2..4 were never applied, so they come again; 0, 1 do not.
    c2 = QueueConsumer(kv, state=saved)
    assert [g.meta["i"] for g in c2.poll(0)] == [2, 3, 4, 5]
    assert c2.poll(0) == []
    # GC deletes only what the saved checkpoint passed.
    assert c2.commit(saved) == 2
    assert {GroupKey.parse(k.decode()).name for k in kv.list().result() if k.startswith(b"groups/")} == \
        {GroupKey.parse(k).name for k in keys[2:]}
    assert c2.stats()["consumed_groups"] == 6 and c2.stats()["queue_depth_groups"] == 0

  def test_producer_restart_after_gc_sorts_after_cursor(self, store, monkeypatch):
    kv, _ = store
    p = QueueProducer(kv, "w0")
    p.append({}, {"i": 0}, policy_version=0)
    c = QueueConsumer(kv)
    c.poll(0)
    c.commit(c.state())                                    # everything of w0 is gone from the store
    assert not [k for k in kv.list().result() if k.startswith(b"groups/")]
    # A restarted producer whose clock went backwards still writes after the cursor: it reads committed.json.
    monkeypatch.setattr(queue_lib.time, "time_ns", lambda: 5)
    p2 = QueueProducer(kv, "w0")
    p2.append({}, {"i": 1}, policy_version=0)
    assert [g.meta["i"] for g in c.poll(0)] == [1]

  def test_append_group_and_rows_batching(self, store):
    kv, _ = store
    p = QueueProducer(kv, "w")
    p.append_group([_traj(8, 3, 1.0, n_segments=2), _traj(8, 3, 0.0)], group_id="g0")   # 3 rows
    p.append_group([_traj(8, 4, 1.0), _traj(8, 5, 0.0)], group_id="g1")                 # 2 rows
    p.append_group([_traj(8, 5, 1.0)] * 2, group_id="g2")                               # 2 rows
    c = QueueConsumer(kv, StalenessConfig(max_staleness=10))
    first = c.poll(5, max_rows=4)
    assert [g.tree()["meta"]["group_id"] for g in first] == ["g0"]       # g1 would overflow 4 rows: waits
    assert c.held_back is not None and c.held_back.n_rows == 2 and c.depth() == (2, 4)
    assert first[0].key.version == 3 and first[0].staleness == 2 and first[0].key.n_rows == 3
    _assert_tree_equal(first[0].trajectories()[0], _traj(8, 3, 1.0, n_segments=2))
    second = c.poll(5, max_rows=4)
    assert [g.tree()["meta"]["group_id"] for g in second] == ["g1", "g2"] and c.held_back is None   # the end
    p.append_group([_traj(8, 5, 1.0)] * 3, group_id="g3")                               # 3 rows
    # What is left of a 4-row batch (2) is not the batch: the group waits rather than failing ...
    assert c.poll(5, max_rows=2, batch_rows=4) == [] and c.held_back.n_rows == 3
    # ... but a group larger than the whole batch can never be batched.
    with pytest.raises(ValueError, match="3 rows, more than the batch's 2"):
      c.poll(5, max_rows=2)

  def test_a_group_that_does_not_fit_waits_at_the_cursor(self, store):
    """poll(fits=...): a group the caller rejects (e.g. its tokens do not pack) is not consumed; it comes next."""
    kv, _ = store
    p = QueueProducer(kv, "w")
    for gid in ("g0", "g1", "g2"):
      p.append_group([_traj(8, 0, 1.0)] * 2, group_id=gid)
    c = QueueConsumer(kv, StalenessConfig(max_staleness=10))
    seen = []

    def fits(g):
      seen.append(g.tree()["meta"]["group_id"])
      return len(seen) == 1
    assert [g.tree()["meta"]["group_id"] for g in c.poll(0, fits=fits)] == ["g0"]
    assert seen == ["g0", "g1"] and c.stats()["consumed_groups"] == 1 and c.depth() == (2, 4)
    held = c.held_back
    (g1,) = c.poll(0, fits=lambda g: True, max_groups=1)
    assert g1.tree()["meta"]["group_id"] == "g1" and g1.key == held   # the group it stopped at comes next
    assert c.held_back is None                                        # stopped for max_groups: nothing refused
    assert [g.tree()["meta"]["group_id"] for g in c.poll(0, fits=lambda g: True)] == ["g2"]

  @pytest.mark.parametrize("policy", ["drop", "keep"])
  def test_staleness_policies(self, store, policy):
    kv, _ = store
    p = QueueProducer(kv, "w")
    for v in [0, 1, 2, 3, 4]:
      p.append({"x": np.full((3,), v)}, {"v": v}, policy_version=v, n_rows=2)
    c = QueueConsumer(kv, StalenessConfig(max_staleness=2, policy=policy))
    got = c.poll(4)
    st = c.stats()
    if policy == "drop":                                   # versions 0, 1 are 4 and 3 behind: dropped, counted
      assert [g.meta["v"] for g in got] == [2, 3, 4]
      assert st["dropped_stale"] == 2 and st["kept_stale"] == 0
    else:
      assert [g.meta["v"] for g in got] == [0, 1, 2, 3, 4]
      assert [g.over_stale for g in got] == [True, True, False, False, False]
      assert st["dropped_stale"] == 0 and st["kept_stale"] == 2
    assert [g.staleness for g in got] == [4 - g.meta["v"] for g in got]
    assert st["staleness_hist"] == {4 - g.meta["v"]: 1 for g in got}
    assert st["queue_depth_groups"] == 0                   # dropped groups are passed too (never re-examined)
    assert c.poll(4) == []

  def test_reopened_store_and_foreign_keys(self, store):
    kv, spec = store
    p = QueueProducer(kv, "w")
    p.append({"a": np.arange(3)}, None, policy_version=1)
    kv.write("groups/w/README", b"not a group").result()
    c = QueueConsumer(kv if spec is None else spec)             # a second handle opened from the spec string
    (g,) = c.poll(1)
    np.testing.assert_array_equal(g.arrays["a"], np.arange(3))

  def test_open_store_rejects_bad_json_spec(self):
    with pytest.raises(ValueError, match="not a JSON kvstore spec"):
      open_store('{"driver": "s3", bucket}')

  def test_bad_arguments(self):
    kv = open_store("memory://")
    with pytest.raises(ValueError, match="producer_id"):
      QueueProducer(kv, "a/b")
    with pytest.raises(ValueError, match="policy_version"):
      QueueProducer(kv, "a").append({}, None, policy_version=-1)
    with pytest.raises(ValueError, match="Unknown staleness policy"):
      StalenessConfig(policy="reweight")
    with pytest.raises(ValueError, match="unknown consumer state"):
      QueueConsumer(kv, state={"cursr": {}})

  def test_corrupt_record_is_skipped_and_counted(self, store):
    kv, _ = store
    p = QueueProducer(kv, "w")
    k = p.append({"a": np.arange(4)}, {"i": 0}, policy_version=0)
    p.append({"a": np.arange(4)}, {"i": 1}, policy_version=0)
    kv.write(k, kv.read(k).result().value[:-3]).result()  # simulate storage corruption
    c = QueueConsumer(kv)
    with pytest.warns(UserWarning, match="unreadable"):
      got = c.poll(0)
    assert [g.meta["i"] for g in got] == [1] and c.stats()["corrupt"] == 1
