"""Test-wide JAX settings: fake devices, the compilation cache, and rank promotion as an error."""
import os
import tempfile

# Eight fake CPU devices so sharded code can be tested on one machine; set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Compiled programs are cached on disk and shared with the subprocesses tests start (a resumed run recompiles the
# same step); compiles here take seconds each, so this is most of a rerun's time.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))

# Gold-validation checks are reused by content (rollout/evaluation/gold_cache.py); tests keep theirs in a directory of
# their own run, so one run's checks are never another's result and nothing is written under the home directory.
os.environ.setdefault("COMPOSER_JAX_GOLD_CACHE", tempfile.mkdtemp(prefix="composer_gold_"))
os.environ.pop("COMPOSER_JAX_EVAL_CACHE", None)   # evaluation results are never read from a cache in tests

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
