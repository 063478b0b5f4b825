"""Claiming a run's workdir: one live run at a time, and a resume only with the config the workdir was started with.

A workdir holds one run's checkpoints, queue, demonstrations and evaluations; two processes writing into it crash
each other mid-save, and a resume with another config either fails deep inside a checkpoint restore (another model
shape) or silently continues with other settings (another KL). So a run first takes `workdir/lock` (an exclusive
`flock`: the kernel drops it when its process dies, so a crashed run's lock is taken over without a stale file to
clean), then compares its config with the stored `run_config.pkl` and refuses a difference the user did not allow
by name (`allow`: e.g. `rl.steps` to grow a run to more RL steps).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import os
import pickle
import socket

from composer_jax.parallel import distributed
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.rl import processes, setup
from composer_jax.rl.config import RunConfig, RunInputError

LOCK = "lock"
RUN_CONFIG = "run_config.pkl"
# Fields a resumed run may change without asking: where the workdir is written from, the bar, and the held-out
# evaluation (it runs after RL, keeps its results per policy and task, and its control is sized once).
FREE_TO_CHANGE = ("workdir", "progress_bar", "eval")
_ABSENT = "<absent>"   # a field an older run's stored config does not have


class WorkdirError(RunInputError):
  """The workdir cannot be used as it is (a file, in use, or another run's): the user's to fix."""


_held: dict[str, int] = {}   # lock path -> nesting depth, so the experiment and its RL loop share one claim


@contextlib.contextmanager
def lock(workdir: str):
  """Holds `workdir/lock` for the block; raises `WorkdirError` at once if a live process holds it. Re-entrant in
  one process (the experiment holds it around the RL loop, which also claims it when run alone)."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"workdir {workdir} is a file, not a directory: pass another --workdir")
  os.makedirs(workdir, exist_ok=True)
  path = os.path.realpath(os.path.join(workdir, LOCK))
  if path in _held:
    _held[path] += 1
    try:
      yield
    finally:
      _held[path] -= 1
    return
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    os.close(fd)
    raise WorkdirError(f"workdir {workdir} is in use by a live run ({holder}): wait for it to finish, stop it, "
                       "or pass another --workdir") from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {datetime.datetime.now():%Y-%m-%d %H:%M:%S}"
            .encode(), 0)
  _held[path] = 1
  try:
    yield
  finally:
    del _held[path]
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def flatten(cfg, prefix: str = "") -> dict[str, object]:
  """Dotted field path -> value of a nested config dataclass (a field a stored older config lacks: `_ABSENT`)."""
  out: dict[str, object] = {}
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name, _ABSENT)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      out.update(flatten(value, f"{prefix}{f.name}."))
    else:
      out[prefix + f.name] = value
  return out


def changes(stored, now, allow=()) -> dict[str, tuple]:
  """{field: (stored, now)} of the fields that differ, except those under `FREE_TO_CHANGE` or `allow` (a name
  allows itself and every field under it)."""
  old, new = flatten(stored), flatten(now)
  free = tuple(FREE_TO_CHANGE) + tuple(allow)
  under = lambda k: any(k == a or k.startswith(a + ".") for a in free)   # noqa: E731
  return {k: (old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in sorted(set(old) | set(new))
          if old.get(k, _ABSENT) != new.get(k, _ABSENT) and not under(k)}


def stored_config(workdir: str):
  """The run config pickled in `workdir`, or None when there is none."""
  path = os.path.join(workdir, RUN_CONFIG)
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    try:
      return pickle.load(f)
    except (AttributeError, ModuleNotFoundError) as e:   # a class an older composer_jax had
      raise WorkdirError(f"{path} was written by an older composer_jax whose run config no longer loads ({e}): "
                         "pass another --workdir") from None


def check_resume(cfg, allow=()) -> None:
  """Raises `WorkdirError` naming each field where `cfg` differs from the config `cfg.workdir` was started with
  (but those free to change or named in `allow`)."""
  stored = stored_config(cfg.workdir)
  if stored is None:
    return
  if type(stored).__name__ != type(cfg).__name__:
    raise WorkdirError(f"{cfg.workdir}/{RUN_CONFIG} holds a {type(stored).__name__}, not a {type(cfg).__name__}: "
                       "pass another --workdir")
  diff = changes(stored, cfg, allow)
  if not diff:
    return
  shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in list(diff.items())[:8])
  more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
  hint = "" if more else (f", or, if the change is meant (e.g. rl.steps to grow the run), resume with "
                          f"--resume_with_changes={','.join(diff)}")
  raise WorkdirError(f"workdir {cfg.workdir} holds a run started with another config ({shown}{more}): pass another "
                     f"--workdir{hint}")


def save_config(cfg) -> bytes | None:
  """Pickles `cfg` into its workdir (atomically: a reader never sees half a file); returns the stored config it
  replaced, pickled (None: there was none), for `claim` to put back when the run's input is refused."""
  os.makedirs(cfg.workdir, exist_ok=True)
  path = os.path.join(cfg.workdir, RUN_CONFIG)
  replaced = None
  if os.path.exists(path):
    with open(path, "rb") as f:
      replaced = f.read()
  with open(path + ".tmp", "wb") as f:
    pickle.dump(cfg, f)
  os.replace(path + ".tmp", path)
  return replaced


@contextlib.contextmanager
def claim(cfg, allow=()):
  """The run's pieces (`setup.open_run`) for a block that holds `cfg.workdir`'s lock. Process 0 takes the lock,
  checks the resume and stores `cfg` as the run's config, then opens the run on the run's mesh (`cfg.mesh`, built
  here once in each process, for the warm start and the RL step alike); building its pieces checks its input, and a
  run refused for it (or stopped before it is open) puts the stored config back as it was, so it leaves none that a
  fixed rerun would differ from. The other processes open theirs after process 0, from what it froze and fitted
  (`rl/processes.py`)."""
  with contextlib.ExitStack() as stack:
    def first():
      stack.enter_context(lock(cfg.workdir))
      check_resume(cfg, allow)
      return save_config(cfg)

    def opened() -> setup.Run:
      mesh = mesh_lib.mesh_from_config(cfg.mesh)
      return stack.enter_context(setup.open_run(cfg, mesh))
    replaced = processes.on_primary("claim", first)
    try:
      run = processes.primary_first("open_run", opened)
    except BaseException:   # refused for its input (or stopped): the run never started
      if distributed.is_primary():   # the stored config as it was
        path = os.path.join(cfg.workdir, RUN_CONFIG)
        if replaced is None:
          os.remove(path)
        else:
          with open(path + ".tmp", "wb") as f:
            f.write(replaced)
          os.replace(path + ".tmp", path)
      raise
    yield run


def load_run_config(workdir: str):
  """The `RunConfig` a run stored in `workdir` (worker processes and `python -m composer_jax.rl.loop` read it)."""
  cfg = stored_config(workdir)
  if cfg is None:
    raise FileNotFoundError(f"{workdir}/{RUN_CONFIG} does not exist: not an RL run's workdir")
  if not isinstance(cfg, RunConfig):
    raise TypeError(f"{workdir}/{RUN_CONFIG} holds a {type(cfg).__name__}, not a RunConfig")
  return cfg
