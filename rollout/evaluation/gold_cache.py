"""Gold validation results kept across evaluations, keyed by the content of what decides them.

Gold validation grades every task four times (two runs a side); on a frozen set of real repositories that was
most of an evaluation (16 of 22 minutes on 13 tasks). Its outcome depends only on
  the task          its JSON (prompt, environment spec, hidden tests and labels, gold patch),
  the environment   what the workspace is built from: the commit a repository name resolves to (and the
                    repository's HEAD, whose history dates readable copies of the project), the bytes of a base
                    directory, inline files and setup commands; the interpreter the tests run with (its version,
                    prefix and every installed distribution's version) and the sandbox configuration,
  the grader        the source of the code that builds, grades and validates (`environment.py`, `grade_report.py`,
                    `workspace.py`, `gold.py`, `copies.py`) and the number of runs a side,
so a check is stored under a sha256 of all of these and reused when every one is unchanged; change any (a moved
branch, an upgraded package, an edited grader) and the task is validated again. Outcomes that depend on the
machine's state rather than the task (a grading timeout, an environment that did not build) are never stored.

The directory is `$COMPOSER_JAX_GOLD_CACHE`, else `~/.cache/composer_jax/gold`; delete it to forget every check.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

from rollout.evaluation import atomic

DEFAULT_DIR = "~/.cache/composer_jax/gold"
UNSTORED = ("environment does not build", "timed out")  # reasons that say more about the machine than the task


def default_dir() -> str:
  return os.path.abspath(os.path.expanduser(os.environ.get("COMPOSER_JAX_GOLD_CACHE") or DEFAULT_DIR))


def _tree_digest(path: str) -> str:
  """sha256 over a directory's relative paths, file modes and bytes (symlinks by their target)."""
  h = hashlib.sha256()
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
      p = os.path.join(root, name)
      h.update(os.path.relpath(p, path).encode() + b"\0")
      if os.path.islink(p):
        h.update(b"link:" + os.readlink(p).encode())
      else:
        h.update(oct(os.stat(p).st_mode).encode())
        with open(p, "rb") as f:
          h.update(hashlib.sha256(f.read()).digest())
  return h.hexdigest()


def environment_key(env) -> str | None:
  """The content an `Environment` builds from, or None when it cannot be resolved (then nothing is stored)."""
  d = {"files": sorted(env.files.items()), "setup": list(env.setup)}
  if env.repo:
    # HEAD too: the history after the task's commit dates the copies of the project the interpreter can read.
    out = subprocess.run(["git", "-C", env.repo, "rev-parse", f"{env.commit}^{{commit}}", "HEAD^{commit}"],
                         capture_output=True, text=True)
    if out.returncode != 0:
      return None
    d["commit"], d["head"] = out.stdout.split()
  if env.base_dir:
    if not os.path.isdir(env.base_dir):
      return None
    d["base_dir"] = _tree_digest(env.base_dir)
  return hashlib.sha256(json.dumps(d).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def interpreter_key() -> str:
  """The Python the workspaces run (the one running this code, whose prefix the sandbox binds) and its packages."""
  dists = sorted({(d.metadata["Name"] or "", d.version) for d in importlib.metadata.distributions()})
  return hashlib.sha256(json.dumps([sys.version, os.path.realpath(sys.prefix), dists]).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def grader_key() -> str:
  """The source of the code that decides a gold check (found, not imported: `gold` imports this module)."""
  h = hashlib.sha256()
  for name in ("rollout.tasks.environment", "rollout.tasks.grade_report", "rollout.workspace",
               "rollout.evaluation.gold", "rollout.tasks.copies"):
    with open(importlib.util.find_spec(name).origin, "rb") as f:
      h.update(f.read())
  return h.hexdigest()


def _factory_key(factory) -> str:
  """The workspace factory's kind and sandbox configuration (limits, binds and environment can change outcomes)."""
  return f"{type(factory).__name__}:{getattr(getattr(factory, 'backend', None), 'config', None)!r}"


class GoldCache:
  """Stored gold checks in `directory` (None: the default, see the module docstring)."""

  def __init__(self, directory: str | None = None):
    self.directory = os.path.abspath(directory) if directory else default_dir()
    self.hits = 0

  def key(self, task, envs, runs: int) -> str | None:
    env = environment_key(task.environment)
    if env is None:
      return None
    parts = [task.to_dict(), env, interpreter_key(), _factory_key(envs.factory), grader_key(), runs]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

  def _path(self, key: str) -> str:
    return os.path.join(self.directory, key[:2], key + ".json")

  def get(self, key: str | None) -> dict | None:
    """The stored check (GoldCheck fields) under `key`, or None."""
    if key is None:
      return None
    try:
      with open(self._path(key), encoding="utf-8") as f:
        row = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):  # absent, or a write cut short: validate again
      return None
    self.hits += 1
    return row

  def put(self, key: str | None, check) -> None:
    """Stores `check` (a GoldCheck) unless its outcome depends on the machine (see `UNSTORED`)."""
    if key is None or any(u in check.reason for u in UNSTORED):
      return
    atomic.write_text(self._path(key), json.dumps(dataclasses.asdict(check)))  # a reader sees the whole check or none
