"""orbax checkpoints of the whole training state and the data iterator (or, for RL, the queue cursor), saved together.

Resume order: build the abstract state and its shardings → `restore` onto them (params, optimizer
state, step, RNG) → restore the grain iterator in place → continue from `step`. A checkpoint is written to a
temporary directory and renamed when complete, so a run killed mid-save resumes from the previous one. A save that
runs out of disk space raises `CheckpointDiskFullError` (the unfinished copy deleted, the previous checkpoint intact);
a rerun once space is back resumes from that previous one.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil

import grain
import jax
import orbax.checkpoint as ocp

from rollout.queue import is_disk_full


class CheckpointDiskFullError(OSError):
  """A checkpoint could not be written for lack of space; the previous complete one is intact."""


class Checkpointer:
  """orbax CheckpointManager for (train state, data iterator or JSON `meta`) in `workdir/checkpoints`.

  The LM stages save the grain iterator beside the state; the RL trainer saves its queue consumer's cursor as
  `meta` (a JSON dict), so a restore re-delivers exactly the groups after the saved step.
  """

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._mgr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                             cleanup_tmp_directories=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
                       "queue": ocp.JsonCheckpointHandler()})
    self._pending: int | None = None   # the step being saved, until `wait` saw it finish

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, state, data_iter=None, *, meta: dict | None = None, force: bool = False) -> None:
    items = {"state": ocp.args.StandardSave(state)}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    if meta is not None:
      items["queue"] = ocp.args.JsonSave(meta)
    self._pending = step
    with self._disk_full_is_clear():
      self._mgr.save(step, args=ocp.args.Composite(**items), force=force)

  @contextlib.contextmanager
  def _disk_full_is_clear(self):
    """Turns a full disk during a save (raised by `save`, or by `wait` for an async one) into one clear error,
    after deleting the unfinished checkpoint's temporary directory (orbax leaves it, holding the space)."""
    try:
      yield
    except Exception as e:
      if not is_disk_full(e) or self._pending is None:
        raise
      step, self._pending = self._pending, None
      for tmp in glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")):
        shutil.rmtree(tmp, ignore_errors=True)
      last = self._mgr.latest_step()
      raise CheckpointDiskFullError(
          errno.ENOSPC, f"checkpoint step {step} could not be written to {self.directory}: the disk is full "
          f"({shutil.disk_usage(self.directory).free} bytes free after removing the unfinished copy). The last "
          f"complete checkpoint is {'step ' + str(last) if last is not None else 'none'} and it is intact; free "
          "space and rerun to resume from it") from e

  def restore(self, abstract_state, data_iter=None, step: int | None = None):
    """Restores onto `abstract_state` (ShapeDtypeStructs with shardings); the iterator is restored in place."""
    step = self._mgr.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}")
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    restored = self._mgr.restore(step, args=ocp.args.Composite(**items))
    return restored["state"]

  def restore_meta(self, step: int | None = None) -> dict:
    """The JSON `meta` saved with `step` (default: the latest)."""
    step = self._mgr.latest_step() if step is None else step
    return self._mgr.restore(step, args=ocp.args.Composite(queue=ocp.args.JsonRestore()))["queue"]

  def wait(self) -> None:
    with self._disk_full_is_clear():
      self._mgr.wait_until_finished()
    self._pending = None

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()


def abstract_like(tree, shardings):
  """ShapeDtypeStructs carrying `shardings`, the restore target for a state shaped like `tree`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
