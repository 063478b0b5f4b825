"""The persistent compilation cache: a second process finds the first one's programs, and every entry point turns
the cache on."""
import ast
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Compiles one program before the cache is on (the cache must still start working) and one after; prints how many
# compiles were served from the cache.
SCRIPT = """
import sys
import jax, jax.numpy as jnp
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("/cache_hits") else None)
jax.jit(lambda x: x + 1)(1.0).block_until_ready()
from composer_jax.compile_cache import enable_compilation_cache
assert enable_compilation_cache(sys.argv[1]) == sys.argv[1]
jax.jit(lambda x: jnp.sin(x) * 2 + jnp.cos(x))(jnp.ones(64)).block_until_ready()
print("hits", len(hits))
"""


def _run(cache_dir):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  out = subprocess.run([sys.executable, "-c", SCRIPT, cache_dir], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  return int(out.stdout.split("hits")[-1])


def test_second_process_reads_the_first_ones_programs(tmp_path):
  cache = str(tmp_path / "xla")
  assert _run(cache) == 0 and os.listdir(cache)       # a cold cache: compiled, then written
  assert _run(cache) >= 1                              # the same programs: read back, not compiled


def _calls_enable(path: str) -> bool:
  tree = ast.parse(open(path).read())
  return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) ==
             "enable_compilation_cache" for n in ast.walk(tree))


# Entry points that never import JAX (so compile nothing): report_main renders results.json into tables and plots.
NO_JAX_MAINS = {"report_main.py": "composer_jax.rl.report"}


def test_every_entry_point_turns_the_cache_on():
  mains = sorted(glob.glob(os.path.join(ROOT, "experiments", "*_main.py")))
  assert mains
  missing = [p for p in mains + [os.path.join(ROOT, "composer_jax", "rl", "worker_process.py")]
             if os.path.basename(p) not in NO_JAX_MAINS and not _calls_enable(p)]
  assert not missing, f"entry points without enable_compilation_cache(): {missing}"
  for module in NO_JAX_MAINS.values():   # the exemption holds only while they stay JAX-free
    code = f"import sys; import {module}; assert 'jax' not in sys.modules, 'imports jax'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
