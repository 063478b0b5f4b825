"""The persistent XLA compilation cache, turned on by every entry point so a repeated or resumed run skips compiles.

Compiles dominate a short run on a CPU (the colab train step takes ~20 s to compile under load, the RL step, the
engine's buckets and the evaluation programs as much again), and the programs are the same from one `make run` to
the next. JAX keys each cached executable on the program, its shardings, the backend and the jax version, so a
stale entry is never reused; delete the directory to reclaim its space.
"""
from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

DEFAULT_DIR = "~/.cache/composer_jax/xla"


def enable_compilation_cache(path: str | None = None) -> str:
  """Turns on JAX's persistent compilation cache and returns its directory.

  Args:
    path: the cache directory; default `$JAX_COMPILATION_CACHE_DIR`, else `~/.cache/composer_jax/xla`.

  The directory is also exported as `JAX_COMPILATION_CACHE_DIR`, so processes this one starts (rollout workers)
  share it. Call it early in a main; a call after something has compiled still takes effect for later compiles.
  """
  path = os.path.abspath(os.path.expanduser(path or os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_DIR))
  os.makedirs(path, exist_ok=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  jax.config.update("jax_compilation_cache_dir", path)
  compilation_cache.reset_cache()   # the cache is set up once per process, at the first compile: redo it
  return path
