"""A multi-process RL trainer: every process runs the same step on its devices; process 0 alone talks to the queue.

Who does what (composer_jax/rl/README.md, "On a mesh and across processes"):
  process 0     polls the queue (the rollout source), writes `applied.jsonl` and the metrics, commits the queue
                cursor after each checkpoint, starts and restarts the rollout workers, publishes the weight files
  every process reads the same groups, builds the same global batch and places only the rows its devices hold,
                runs the step (a collective), takes part in each orbax checkpoint and in each Hugging Face export
                (writing the tensors its devices hold)

A step's groups reach the other processes as their queue keys (`share_groups`: a broadcast of a few hundred bytes);
each process then reads those records from the queue's store itself, which every process can reach (a shared file
system or an object store). Nothing is deleted before they have read it: the cursor is committed only after the
step's checkpoint, which all processes reach only after the step, so after their reads.
"""
from __future__ import annotations

import json

import jax
import numpy as np

from rollout import queue_codec
from rollout.queue import ConsumedGroup, GroupKey


def _broadcast_bytes(data: bytes) -> bytes:
  """Process 0's `data` in every process (the others pass anything)."""
  from jax.experimental import multihost_utils
  n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
  buf = np.frombuffer(data, np.uint8) if jax.process_index() == 0 else np.zeros(n, np.uint8)
  return np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes()


def share_groups(groups: list[ConsumedGroup] | None, kv) -> list[ConsumedGroup]:
  """This step's groups in every process: process 0's `groups` (the others pass None) as it polled them, their
  records read back from `kv` (the queue's store) by key elsewhere. One process: `groups` as they are."""
  if jax.process_count() == 1:
    return groups
  keys = [[g.key.key, g.staleness, g.over_stale] for g in groups] if jax.process_index() == 0 else []
  keys = json.loads(_broadcast_bytes(json.dumps(keys).encode()))
  if jax.process_index() == 0:
    return groups
  out = []
  for key, staleness, over_stale in keys:
    r = kv.read(key).result()
    if r.state != "value":
      raise FileNotFoundError(f"queue record {key} (polled by process 0) is not readable from process "
                              f"{jax.process_index()}: the queue's store must be shared by every process")
    arrays, meta = queue_codec.decode(r.value)
    out.append(ConsumedGroup(GroupKey.parse(key), staleness, over_stale, arrays, meta))
  return out
