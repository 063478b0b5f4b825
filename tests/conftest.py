"""Test-wide JAX settings: fake devices, the compilation cache, and rank promotion as an error."""
import os

# Eight fake CPU devices so sharded code can be tested on one machine; set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Compiled programs are cached on disk and shared with the subprocesses tests start (a resumed run recompiles the
# same step); compiles here take seconds each, so this is most of a rerun's time.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
