"""The scale plan's peak buffers (`benchmarks/hlo_costs.peak_buffers`) on hand-built programs compiled in a fresh
process with XLA's dumps on: each buffer attributed to its source op, and XLA:CPU-only bytes apart — f32 copies of
bf16 values whose original stays live, the widened half of a value the program holds in bf16 — while a bf16 stack a
scan saved for the backward, which XLA:CPU converts whole and frees, counts as a real bf16 buffer."""
import json
import pathlib
import subprocess
import sys

from benchmarks import hlo_costs

ROOT = pathlib.Path(__file__).resolve().parents[1]

HEADER = """
import json, sys
import jax, jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from benchmarks import hlo_costs, hlo_module
"""
FOOTER = """
module = hlo_module.parse_module(compiled.as_text())
print(json.dumps(hlo_costs.peak_buffers(module, hlo_costs.live_range_text(sys.argv[1], sys.argv[2]))))
"""

MATMULS = """
def f(w_bf16, x_bf16):
  y = jnp.einsum("erd,edf->erf", x_bf16, w_bf16, preferred_element_type=jnp.float32)
  with jax.named_scope("second_product"):
    z = jnp.einsum("erf,edf->erd", y.astype(jnp.bfloat16), w_bf16)
  return z, jnp.sum(y, axis=1)
args = (jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16), jax.ShapeDtypeStruct((8, 1024, 256), jnp.bfloat16))
compiled = jax.jit(f).lower(*args).compile()
"""

# Six scanned layers, each saving a bf16 [E, R, F] product for its backward (a named remat residual, as the EP
# return exchange's result is saved) and scaling it by a gate; the weights and gates are bf16 arguments.
SAVED_STACK = """
L, E, R, D = 6, 4, 128, 256
def loss(w_bf16, g_bf16, x_bf16):
  def layer(c, wg):
    w, g = wg
    y = checkpoint_name(jnp.einsum("erd,edf->erf", c, w), "saved")
    return jnp.tanh(jnp.einsum("erf,er->erf", y, g)), None
  f = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("saved"))
  return jnp.sum(jax.lax.scan(f, x_bf16, (w_bf16, g_bf16))[0].astype(jnp.float32) ** 2)
args = (jax.ShapeDtypeStruct((L, E, D, D), jnp.bfloat16), jax.ShapeDtypeStruct((L, E, R), jnp.bfloat16),
        jax.ShapeDtypeStruct((E, R, D), jnp.bfloat16))
compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
"""


def _peak(program: str, module_name: str, tmp_path) -> dict:
  env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
         "XLA_FLAGS": hlo_costs.dump_flags(str(tmp_path))}
  out = subprocess.run([sys.executable, "-c", HEADER + program + FOOTER, str(tmp_path), module_name],
                       capture_output=True, text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_buffers_are_attributed_and_cpu_only_copies_shown_apart(tmp_path):
  """Batched bf16 matmuls, which XLA:CPU runs in f32: the output is named by its scope; XLA:CPU's f32 copy of the
  bf16 weight w is all CPU-only (w stays live, and a GPU reads it); its widened y.astype(bf16) is half CPU-only (the
  program holds that value in bf16); the bf16 arguments are not."""
  peak = _peak(MATMULS, "jit_f", tmp_path)
  by_type = {b["type"].split("{")[0]: b for b in peak["largest"]}
  z, w_copy, y_bf16 = by_type["f32[8,1024,256]"], by_type["f32[8,256,512]"], by_type["f32[8,1024,512]"]
  assert "second_product" in z["source"] and "second_product" in y_bf16["source"]
  assert w_copy["source"] == "w_bf16" and w_copy["cpu_only"] == w_copy["bytes"] == 8 * 256 * 512 * 4
  assert "holds_instead" not in w_copy
  assert y_bf16["cpu_only"] == y_bf16["bytes"] // 2 == 8 * 1024 * 512 * 2
  assert by_type["bf16[8,256,512]"]["cpu_only"] == 0
  assert peak["cpu_only_bytes"] == sum(b["cpu_only"] for b in peak["largest"])
  assert peak["bytes"] == sum(b["bytes"] for b in peak["largest"])


def test_a_scan_saved_bf16_stack_converted_and_freed_counts_as_bf16(tmp_path):
  """XLA:CPU converts the forward scan's saved bf16 stacks [6, 4, 128, 256] to f32 after the loop and frees the
  bf16 stacks (the loop's outputs are not live at the peak): a GPU would hold each bf16 stack, so half of each f32
  copy is CPU-only, and the copy names the loop output it stands for. The f32 copy of the weight stack, whose bf16
  argument stays live, is still all CPU-only."""
  peak = _peak(SAVED_STACK, "jit_loss", tmp_path)
  stack = 6 * 4 * 128 * 256
  saved = [b for b in peak["largest"] if b["type"].startswith("f32[6,4,128,256]")]
  assert saved, [b["type"] for b in peak["largest"]]
  for b in saved:
    assert b["bytes"] == 4 * stack and b["cpu_only"] == 2 * stack, b
    original, index = b["holds_instead"].rstrip("}").split("{")
    assert original.startswith("while") and index and "while" in b["source"]
  w_copy = next(b for b in peak["largest"] if b["type"].startswith("f32[6,4,256,256]"))
  assert w_copy["source"] == "w_bf16" and w_copy["cpu_only"] == w_copy["bytes"] and "holds_instead" not in w_copy
