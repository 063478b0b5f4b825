"""Fault: unreadable queue entries (truncated, damaged, from a newer codec version) are skipped, counted apart and
named in the log; every good group around them is delivered exactly once, across a trainer restore, and nothing
crashes. Runs on the memory, file and S3 kvstores."""
import struct
import zlib

import numpy as np
import pytest
from s3_testlib import BACKENDS, queue_store, s3_endpoint  # noqa: F401  (s3_endpoint: a fixture)

from rollout import queue_codec
from rollout.queue import QueueConsumer, QueueProducer


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
  return queue_store(request.param, tmp_path, request)


def _newer(blob: bytes) -> bytes:
  """The record as a version-2 writer would store it: same body, next version in the magic, a valid checksum."""
  body = b"CJQ2" + blob[4:-4]
  return body + struct.pack("<I", zlib.crc32(body))


def _bad_header(blob: bytes) -> bytes:
  """A whole, checksummed record whose header lies about its data (a writer's bug)."""
  hlen = struct.unpack("<I", blob[4:8])[0]
  header = blob[8:8 + hlen].replace(b'"nbytes": 32', b'"nbytes": 31')
  body = blob[:8] + header + blob[8 + hlen:-4]
  return body + struct.pack("<I", zlib.crc32(body))


DAMAGE = {"truncated": lambda b: b[:len(b) // 2], "bit_flip": lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:],
          "empty": lambda b: b"", "newer_format": _newer, "bad_header": _bad_header}


def test_codec_names_each_kind_of_unreadable_record():
  blob = queue_codec.encode({"a": np.arange(4, dtype=np.int64) + 1000}, {"i": 0})   # 4 int64 = 32 bytes, kept wide
  for name, damage in DAMAGE.items():
    kind = queue_codec.NewerFormatError if name == "newer_format" else queue_codec.CorruptRecordError
    with pytest.raises(kind) as e:
      queue_codec.decode(damage(blob))
    assert isinstance(e.value, queue_codec.UnreadableRecordError)
  with pytest.raises(queue_codec.NewerFormatError, match="codec version 2; this reader decodes version 1"):
    queue_codec.decode(_newer(blob))


def test_unreadable_entries_are_skipped_counted_and_named_and_good_groups_come_once(store):
  kv, _ = store
  producer = QueueProducer(kv, "w0")
  keys = [producer.append({"a": np.arange(4, dtype=np.int64) + 1000}, {"i": i}, policy_version=0)
          for i in range(8)]
  damaged = {1: "truncated", 3: "newer_format", 4: "bit_flip", 6: "bad_header"}
  for i, name in damaged.items():
    kv.write(keys[i], DAMAGE[name](kv.read(keys[i]).result().value)).result()

  consumer = QueueConsumer(kv)
  with pytest.warns(UserWarning) as caught:
    first = consumer.poll(0, max_groups=2)          # 0, 2 (1 skipped on the way)
    saved = consumer.state()                          # the checkpoint
    lost = consumer.poll(0)                           # consumed, then the trainer dies before checkpointing
  assert [g.meta["i"] for g in first] == [0, 2] and [g.meta["i"] for g in lost] == [5, 7]
  # Restored from the checkpoint: the groups consumed after it come again, the unreadable ones are not re-counted
  # beyond the cursor they were skipped at.
  with pytest.warns(UserWarning):
    again = QueueConsumer(kv, state=saved).poll(0)
  assert [g.meta["i"] for g in again] == [5, 7]
  delivered = [g.meta["i"] for g in first + again]
  assert delivered == [0, 2, 5, 7]                  # every readable group once, in order
  stats = consumer.stats()
  assert (stats["corrupt"], stats["newer_format"]) == (3, 1) and stats["consumed_groups"] == 4
  named = [str(w.message) for w in caught]
  for i, name in damaged.items():
    assert any(keys[i] in m for m in named), (name, named)
  assert any("newer_format" in m and "codec version 2" in m for m in named)
  assert [s["key"] for s in consumer.state()["skipped"]] == [keys[i] for i in sorted(damaged)]


def test_producer_counters_reach_the_consumer_stats_and_survive_a_restart(store):
  kv, _ = store
  QueueProducer(kv, "w0").count("groups_dropped")
  again = QueueProducer(kv, "w0")                   # a restarted worker keeps counting from its stored counts
  again.count("groups_dropped", 2)
  QueueProducer(kv, "w1").count("groups_retried")
  stats = QueueConsumer(kv).stats()
  assert stats["groups_dropped"] == 3 and stats["groups_retried"] == 1
