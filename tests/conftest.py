"""Test-wide JAX settings (STYLE.md §13)."""
import os

# Eight fake CPU devices so sharded code can be tested on one machine; set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
