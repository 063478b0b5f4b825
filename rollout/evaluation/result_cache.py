"""Results of deterministic evaluations kept across runs, so nothing is evaluated twice.

An evaluation is deterministic when its engine's outputs are fixed by its weights and settings for seeded requests
(the harness seeds every request) — the embedded JAX engine says so by having `result_key()`, a string that pins
them (a hash of the weights, model and engine configs, the jax version and the engine's code). The runner then
keys a finished evaluation's per-task records by that string, the run settings that define results (the policy
name aside), the tokenizer and the code of `rollout` and `sandboxes`; the same policy evaluated again on the same
tasks — the same SFT start in another run, or under another name — reads them back instead of rerunning every
episode. Records with a grading timeout (load-dependent) are not kept. Engines without `result_key` (scripted
baselines, which cost nothing; SGLang servers, whose weights the client cannot see) are never cached.

The store is a directory of `<key>.jsonl` files, written atomically, found through `runner.run_policy(cache_dir=...)` or
the `COMPOSER_JAX_EVAL_CACHE` environment variable (unset: off).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

from rollout.evaluation import atomic

ENV = "COMPOSER_JAX_EVAL_CACHE"


@functools.cache
def code_fingerprint(*packages: str) -> str:
  """A hash of every .py file under the named top-level packages (their code decides what an episode does)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  digest = hashlib.sha256()
  for pkg in packages:
    for dirpath, dirnames, files in os.walk(os.path.join(root, pkg)):
      dirnames.sort()
      for name in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
          digest.update(f.read())
  return digest.hexdigest()[:16]


def cache_key(engine, tokenizer, settings: dict) -> str | None:
  """The key of an evaluation's results, or None when they are not known to be deterministic."""
  result_key = getattr(engine, "result_key", None)
  to_str = getattr(tokenizer, "to_str", None)
  if result_key is None or to_str is None:
    return None
  parts = {"engine": result_key(), "tokenizer": hashlib.sha256(to_str().encode()).hexdigest(),
           "settings": {k: v for k, v in settings.items() if k != "policy"},
           "code": code_fingerprint("rollout", "sandboxes")}
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def root(cache_dir: str | None) -> str:
  """The store's directory: the argument, else the environment variable; '' = off."""
  return cache_dir if cache_dir is not None else os.environ.get(ENV, "")


def load(store: str, key: str, policy: str) -> list[dict] | None:
  """The records kept under `key`, relabelled with `policy`, or None."""
  path = os.path.join(store, f"{key}.jsonl")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return [{**json.loads(line), "policy": policy} for line in f if line.strip()]


def save(store: str, key: str, records: list[dict]) -> bool:
  """Keeps `records` under `key` unless a sample hit a grading timeout; returns whether they were kept."""
  if any(s.get("grade_timed_out") for r in records for s in r["samples"]):
    return False
  atomic.write_text(os.path.join(store, f"{key}.jsonl"), "".join(json.dumps(r) + "\n" for r in records))
  return True
