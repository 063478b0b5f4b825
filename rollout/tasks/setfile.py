"""Frozen, versioned task-set files: JSON with name, version, how it was built, the tasks, and a sha256 of the tasks
that `read_set` checks (so a set cannot be edited silently). `rollout/evaluation/builder.py` writes them."""

from __future__ import annotations

import hashlib
import json

from rollout.tasks.task import Task

FORMAT = "composer_jax.eval_set/1"


def tasks_digest(task_dicts: list[dict]) -> str:
  """The sha256 recorded in (and checked against) a set file."""
  return hashlib.sha256(json.dumps(task_dicts, sort_keys=True).encode()).hexdigest()


def write_set(path: str, task_set: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(task_set, f, indent=1, sort_keys=True)


def read_set(path: str) -> tuple[dict, list[Task]]:
  """(set header without tasks, tasks); raises if the file is missing, not a set, or its tasks were edited."""
  if not path:
    raise ValueError("no set file given (the 'file' task source needs a path, e.g. set_file=sets/x_v1.json)")
  try:
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"set file {path!r} does not exist") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
  if not isinstance(d, dict) or d.get("format") != FORMAT:
    got = d.get("format") if isinstance(d, dict) else type(d).__name__
    raise ValueError(f"{path}: not a task set file (format {got!r}, want {FORMAT!r})")
  if tasks_digest(d["tasks"]) != d["sha256"]:
    raise ValueError(f"{path}: tasks do not match the recorded sha256; the frozen set was modified")
  return {k: v for k, v in d.items() if k != "tasks"}, [Task.from_dict(t) for t in d["tasks"]]
