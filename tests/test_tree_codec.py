"""rollout/tree_codec.py and the queue: a tree group is stored with its shared prefixes once, comes back exactly,
and is delivered exactly once across a consumer restart."""
import numpy as np
import pytest

from rollout import tree_codec
from rollout.queue import QueueConsumer, QueueProducer, open_store
from rollout.staleness import StalenessConfig
from tests import tree_testlib as tl
from tests.test_tree import NODES, REWARDS


def _summary_tree(n_layers=2):
  seg0 = list(tl.PROMPT) + [1, 2, 60, 3, 4]
  return [{"task_id": "t", "reward": r, "metrics": {"solved": r},
           "segments": [tl.segment(seg0, n_layers), tl.segment(list(tl.PROMPT) + [55, 56, 9] + tail, n_layers)],
           "tree": {"path": [0, j], "starts": [[0, 3], [1, 6]], "multiplicity": 1}}
          for j, (tail, r) in enumerate([([5, 6], 1.0), ([7], 0.0), ([8], 0.5)])]


def assert_same(a, b, where=""):
  if isinstance(a, dict):
    assert a.keys() == b.keys(), where
    for k in a:
      assert_same(a[k], b[k], f"{where}/{k}")
  elif isinstance(a, np.ndarray):
    assert a.dtype == np.asarray(b).dtype, where
    np.testing.assert_array_equal(a, b, err_msg=where)
  elif isinstance(a, (list, tuple)):
    assert len(a) == len(b), where
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
      assert_same(x, y, f"{where}/{i}")
  else:
    assert a == b, where


def _nbytes(trajs):
  return sum(np.asarray(v).nbytes for t in trajs for s in t["segments"] for k, v in s.items()
             if k in tree_codec.PER_TOKEN and v is not None)


@pytest.mark.parametrize("group", [tl.tree_group(NODES, REWARDS, n_layers=2), _summary_tree()],
                         ids=["one_segment", "across_a_summary"])
def test_shared_prefixes_are_stored_once_and_restored_exactly(group):
  stored = tree_codec.share_prefixes(group)
  assert [t.get("shared_prefix") for t in stored][1:] != [None] * (len(group) - 1)
  assert _nbytes(stored) < _nbytes(group)
  assert_same(tree_codec.restore_prefixes(stored), group)


def test_summary_tree_drops_the_shared_segment():
  stored = tree_codec.share_prefixes(_summary_tree())
  assert [len(t["segments"]) for t in stored] == [2, 1, 1]
  assert stored[1]["shared_prefix"] == {"version": 1, "leaf": 0, "until": [1, 6]}
  np.testing.assert_array_equal(stored[2]["segments"][0]["tokens_T"], [8])


def test_a_leaf_that_is_not_a_copy_is_stored_whole():
  group = _summary_tree()
  group[2]["segments"][0]["logprobs_T"][3] += 1.0    # differs from leaf 0 inside the shared prefix
  stored = tree_codec.share_prefixes(group)
  assert "shared_prefix" not in stored[2] and "shared_prefix" in stored[1]
  assert_same(tree_codec.restore_prefixes(stored), group)


def test_flat_groups_pass_through_and_bad_references_fail_clearly():
  flat = tl.flat_group([[1], [2]], [1.0, 0.0])
  assert tree_codec.share_prefixes(flat) == flat
  stored = tree_codec.share_prefixes(_summary_tree())
  stored[1]["shared_prefix"] = {**stored[1]["shared_prefix"], "version": 2}
  with pytest.raises(ValueError, match=r"trajectory 1 .*codec version 2; this reader knows version 1"):
    tree_codec.restore_prefixes(stored)
  stored[1]["shared_prefix"] = {"version": 1, "leaf": 2, "until": [1, 6]}
  with pytest.raises(ValueError, match="trajectory 1 .* does not name an earlier leaf"):
    tree_codec.restore_prefixes(stored)


def test_queue_round_trip_and_exactly_once_across_a_restart():
  kv = open_store("memory://")
  producer = QueueProducer(kv, "w0")
  groups = [_summary_tree(), tl.tree_group(NODES, REWARDS, n_layers=2), _summary_tree()]
  for g in groups:
    producer.append_group(g, policy_version=0)
  consumer = QueueConsumer(kv, StalenessConfig(max_staleness=4))
  (first,) = consumer.poll(0, max_groups=1)
  assert_same(first.trajectories(), groups[0])
  assert first.key.n_rows == 4                   # leaves 1 and 2 skip the segment leaf 0 trains
  saved = consumer.state()
  consumer.poll(0, max_groups=1)                # consumed, but the trainer crashed before checkpointing
  restarted = QueueConsumer(kv, StalenessConfig(max_staleness=4), state=saved)
  again = restarted.poll(0)
  assert len(again) == 2
  for got, want in zip(again, groups[1:], strict=True):
    assert_same(got.trajectories(), want)
  assert restarted.poll(0) == []
