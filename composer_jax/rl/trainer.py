"""The RL trainer's state: started or restored, one jitted RL step per batch of groups, checkpoints with the queue.

State: params, optimizer, step and the queue consumer's cursor, saved in the same orbax checkpoint
(`workdir/checkpoints`), so a restore re-delivers exactly the groups after the saved step. Exactly once:
`applied.jsonl` records which group keys each step trained on; on restore at step s, lines after s are dropped
(those steps are redone, and the restored cursor re-delivers exactly their groups).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from composer_jax.parallel import distributed
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import placement, processes, setup
from composer_jax.train import checkpoint as ckpt_lib
from composer_jax.train import loop as train_loop
from rollout.queue import QueueConsumer
from rollout.staleness import StalenessConfig


def _truncate_applied(path: str, step: int) -> None:
  """Keeps the applied log's lines of steps <= `step` (the restored checkpoint's).

  A torn last line (the disk filled while it was appended) is dropped: the step it recorded raised before its
  checkpoint, so it is redone. A damaged line anywhere else is refused, naming the file and the line.
  """
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  rows = []
  for i, line in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        break
      raise ValueError(f"{path}: line {i + 1} is not JSON ({e.msg}); the applied log is damaged") from None
  with open(path + ".tmp", "w") as f:
    for r in rows:
      if r["step"] <= step:
        f.write(json.dumps(r) + "\n")
  os.replace(path + ".tmp", path)


def reward_terms(trajectories: list[dict]) -> dict[str, float]:
  """Each reward term's mean over a step's trajectories (`reward/<term>`), so metrics.jsonl shows over training
  which terms move the reward (the success term, or a penalty being shrunk instead)."""
  keys = sorted({k for t in trajectories for k in t.get("breakdown", {})})
  return {f"reward/{k}": float(np.mean([t["breakdown"].get(k, 0.0) for t in trajectories])) for k in keys}


def level_pass_rates(groups: list) -> dict[str, float]:
  """`pass/level_<n>`: the solved share of a step's trajectories per procedural level (groups whose task has a
  level), so metrics.jsonl holds a learning curve per level of a mix."""
  by_level: dict[int, list[float]] = {}
  for g in groups:
    tree = g.tree()   # decoded once: the meta and the trajectories
    level = tree["meta"].get("level")
    if level is not None:
      by_level.setdefault(level, []).extend(rl_batch.passed(t) for t in tree["trajectories"])
  return {f"pass/level_{lv}": float(np.mean(v)) for lv, v in sorted(by_level.items())}


class Trainer:
  """The jitted RL step on the run's state (`start`: `placement.start_rl_step`, restored or fresh, with the frozen KL
  reference and the run's checkpoints), on batches of `batch_cfg`'s shape. Groups come from the queue in `workdir`,
  filtered by `staleness`."""

  def __init__(self, start: placement.RLStart, batch_cfg: rl_batch.BatchConfig, workdir: str,
               staleness: StalenessConfig, log_fn=print):
    self.rl_step = start.step
    self.state = start.state
    self.ref_params = start.ref_params
    self.ckpts: ckpt_lib.Checkpointer = start.ckpts
    self.batch_cfg = batch_cfg
    self.start = int(self.state.step)   # the step the state was restored at (0: a fresh run)
    self.applied_path = os.path.join(workdir, "applied.jsonl")
    self.primary = distributed.is_primary()   # the one process that polls, logs and commits (`rl/processes.py`)
    if self.primary:
      _truncate_applied(self.applied_path, self.start)
    resumed = self.ckpts.latest_step() is not None
    if resumed:
      log_fn(f"Resumed RL at step {self.start}")
    self.cursor = None   # the queue cursor after the last trained step
    self.consumer = QueueConsumer(setup.queue_url(workdir), staleness,
                                  state=self.ckpts.restore_meta() if resumed else None)
    self._compiled: dict[tuple[int, int], object] = {}   # per batch shape (packed, or a group alone unpacked)

  @property
  def params(self):
    return self.state.params

  def step(self, step_no: int, groups: list | None) -> dict[str, float]:
    """One RL step on `groups` (whole groups of this step; None in the processes but process 0, which receive
    process 0's, `processes.share_groups`); returns its metrics as floats, the queue's after the step's poll among
    them (depth, dropped and kept stale groups, the staleness histogram)."""
    groups = processes.share_groups(groups, self.consumer.kv)
    batch = placement.place_tree(rl_batch.from_consumed(groups, self.batch_cfg), self.rl_step.batch)
    shape = batch["tokens"].shape
    if shape not in self._compiled:
      self._compiled[shape] = self.rl_step.lower(self.state, batch, self.ref_params).compile()
      distributed.barrier(f"rl_step_compiled_{shape[0]}x{shape[1]}")   # compiled at different speeds, as above
    self.state, m = self._compiled[shape](self.state, batch, self.ref_params)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    m.update(reward_terms([t for g in groups for t in g.trajectories()]))
    m.update(level_pass_rates(groups))
    if not np.isfinite(m["loss"]):
      raise train_loop.NonFiniteLossError(f"non-finite RL loss at step {step_no}; last good checkpoint "
                                          f"{self.ckpts.latest_step()}")
    if self.primary:
      with open(self.applied_path, "a") as f:
        f.write(json.dumps({"step": step_no, "keys": [g.key.key for g in groups]}) + "\n")
    self.cursor = self.consumer.state()   # after exactly this step's groups, whatever is consumed before the save
    qs = self.consumer.stats()
    hist = qs.pop("staleness_hist")
    return m | {k: float(v) for k, v in qs.items()} | {f"staleness_{k}": float(v) for k, v in hist.items()}

  def checkpoint(self, step_no: int) -> None:
    """Saves state + queue cursor together, then lets the queue drop what that checkpoint no longer needs. The
    cursor is the one right after the last trained step, so groups consumed since (a step cut short by Ctrl-C) are
    delivered again on resume."""
    qsave = self.cursor if self.cursor is not None else self.consumer.state()
    self.ckpts.save(step_no, self.state, meta=qsave, force=True)   # every process: orbax saves collectively
    self.ckpts.wait()
    if self.primary:
      self.consumer.commit(qsave)

  def close(self) -> None:
    self.ckpts.close()
