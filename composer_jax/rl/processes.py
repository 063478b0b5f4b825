"""The RL run across processes: every process runs the jitted steps on its devices; process 0 alone owns the rest.

Who does what (composer_jax/rl/README.md, "On a mesh and across processes"):
  process 0     takes the workdir's lock and stores its config, freezes the task pools and fits the tokenizer, runs
                the oracle's demonstrations, polls the queue (the rollout source, its workers), writes
                `applied.jsonl`, the metrics and the plots, commits the queue cursor after each checkpoint, writes
                the weight files, runs the SGLang fleet and the held-out evaluations (on its own devices), sizes
                the control and writes results.json
  every process builds the same global batch from the same groups and places only the rows its devices hold,
                runs each SFT and RL step (a collective), takes part in each orbax checkpoint, each weight gather
                and each Hugging Face export (writing the tensors its devices hold)

The processes meet in the coordination service, not in a device collective: process 0 spends minutes where the
others have nothing to do (demonstrations, rollouts, evaluations), and a gloo (CPU) collective gives a late peer
only 30 s. `on_primary` runs a piece of work on process 0 while the others wait for its key; an exception there is
raised in every process. A step's groups reach the others as their queue keys (a few hundred bytes through the
same key-value store); each process then reads those records from the queue's store itself, which every process
can reach (a shared file system or an object store). Nothing is deleted before they have read it: the cursor is
committed only after the step's checkpoint, which all processes reach only after the step, so after their reads.
"""
from __future__ import annotations

import collections
import json
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from composer_jax.parallel import distributed
from composer_jax.rl.config import RunInputError
from rollout import queue_codec
from rollout.queue import ConsumedGroup, GroupKey

WAIT_S = 7 * 24 * 3600   # how long a process waits for process 0's piece of work: a demonstration set or an
                         # evaluation may take hours, and a failure on process 0 is reported, not waited out
_calls: collections.Counter = collections.Counter()   # name -> uses: every process makes the same calls in order


class PrimaryFailed(RuntimeError):
  """Process 0 failed in a piece of work the others waited for."""


def _client():
  from jax._src import distributed as jax_distributed  # the coordination service's key-value store
  return jax_distributed.global_state.client


def on_primary(name: str, fn: Callable[[], object], share: Callable[[object], object] | None = None):
  """`fn()` on process 0 while the others wait for it; returns its value there and, elsewhere, `share(value)`
  (JSON-able; None without `share`). An exception on process 0 is raised in every process: a `RunInputError` as
  one (each process prints the same one line), anything else as `PrimaryFailed`. One process: `fn()`."""
  if jax.process_count() == 1:
    return fn()
  _calls[name] += 1
  key = f"composer_jax/rl/{name}/{_calls[name]}"
  if distributed.is_primary():
    try:
      value = fn()
    except BaseException as e:
      _client().key_value_set(key, json.dumps({"error": f"{type(e).__name__}: {e}",
                                               "input": isinstance(e, RunInputError)}))
      raise
    _client().key_value_set(key, json.dumps({"value": share(value) if share else None}))
    return value
  got = json.loads(_client().blocking_key_value_get(key, WAIT_S * 1000))
  if "error" in got:
    raise (RunInputError if got["input"] else PrimaryFailed)(f"process 0 failed at {name}: {got['error']}")
  return got["value"]


def primary_first(name: str, fn: Callable[[], object]):
  """`fn()` on process 0, then in every other process once it returned there (each builds its own from what
  process 0 froze or fitted); a failure on process 0 is raised in every process, as `on_primary` raises it."""
  value = on_primary(name, fn)
  return value if distributed.is_primary() else fn()


def share_groups(groups: list[ConsumedGroup] | None, kv) -> list[ConsumedGroup]:
  """This step's groups in every process: process 0's `groups` (the others pass None) as it polled them, their
  records read back from `kv` (the queue's store) by key elsewhere. One process: `groups` as they are."""
  if jax.process_count() == 1:
    return groups
  keys = on_primary("step_groups", lambda: groups, share=lambda gs: [[g.key.key, g.staleness, g.over_stale]
                                                                     for g in gs])
  if distributed.is_primary():
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


def for_local_engine(params) -> tuple[object, Mesh | None]:
  """`(params, mesh)` for an engine that process 0 runs alone (rollouts of `mode=sync`, evaluations): in a
  multi-process run the params gathered to the host (a collective: every process calls this) and process 0's own
  devices, to hold a replica each (`JaxEngine(..., mesh=, placement='replicas')`); one process: `(params, None)`,
  the params as they are."""
  if jax.process_count() == 1:
    return params, None
  from jax.experimental import multihost_utils
  full = multihost_utils.process_allgather(params, tiled=True)
  return full, Mesh(np.array(jax.local_devices()), ("replica",))


def publish_weights(directory: str, params, version: int, unless_latest: bool = False) -> None:
  """`weight_files.publish` of the trainer's `params` (`unless_latest`: `publish_unless_latest`); across processes
  they are gathered first (every process calls this) and process 0 writes."""
  from composer_jax.rl import weight_files
  publish = weight_files.publish_unless_latest if unless_latest else weight_files.publish
  full, _ = for_local_engine(params)
  on_primary("publish_weights", lambda: publish(directory, full, version))
