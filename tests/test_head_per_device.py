"""The LM head per device on 8 fake CPU devices (model/head.py `_per_device`) against the one-device head: values and
gradients of every loss, and the collectives it compiles to (the weight gathered, its gradient reduce-scattered, no
logits all-reduced)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import hlo_collectives as hc
from composer_jax.model import head
from composer_jax.parallel import make_mesh
from composer_jax.parallel.rules import ShardingRules, use_rules

B, L, D, V = 4, 16, 32, 96
# Tokens over data x expert (rows) and context (positions); the weight's D over data x context (FSDP), V over tensor.
AXES = {"data": 2, "expert": 2, "context": 2}
RULES = ShardingRules(batch=("data", "expert"), embed=("data", "context"))


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(ks[0], (B, L, D), jnp.float32)
  w = jax.random.normal(ks[1], (D, V), jnp.float32) * 0.3
  t = jax.random.randint(ks[2], (B, L), 0, V)
  th = jax.random.normal(ks[3], (B, L, D), jnp.float32)
  return h, w, t, th


def _loss(h, w, t, th):
  logp, ent = head.token_logprobs(h, w, t, chunk_size=24, with_entropy=True)   # 24: partial chunks per device
  ce, agree = head.distill_cross_entropy(h, w, th, chunk_size=24)
  return jnp.sum(logp * jnp.arange(L)[None]) + 0.3 * jnp.sum(ent) + 0.5 * jnp.sum(ce), (logp, ent, ce, agree)


def _run(mesh=None, rules=None, axes=AXES):
  h, w, t, th = _inputs()
  fn = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True))
  if mesh is None:
    return fn(h, w, t, th), None
  tok = NamedSharding(mesh, P(("data", "expert"), "context"))
  h, th = (jax.device_put(x, NamedSharding(mesh, P(("data", "expert"), "context", None))) for x in (h, th))
  t = jax.device_put(t, tok)
  w = jax.device_put(w, NamedSharding(mesh, P(("data", "context"), "tensor" if "tensor" in axes else None)))
  with jax.set_mesh(mesh), use_rules(rules):
    return fn(h, w, t, th), fn.lower(h, w, t, th).compile().as_text()


@pytest.mark.parametrize("axes", [AXES, {"data": 2, "context": 2, "tensor": 2}])
def test_per_device_head_matches_one_device(axes):
  mesh = make_mesh(axes)
  rules = RULES if "expert" in axes else ShardingRules(embed=("data", "context"))
  ((loss1, aux1), g1), _ = _run()
  ((loss8, aux8), g8), text = _run(mesh, rules, axes)
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  for a, b in zip(aux8, aux1):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  for a, b in zip(g8, g1):   # dh and dw
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert "shard_map" in text


def test_per_device_head_gathers_the_weight_and_reduce_scatters_its_gradient():
  """No collective runs per chunk (the old head all-reduced each chunk's [Tc, V] logits inside its loop): the region
  gathers the weight and reduce-scatters its gradient over the FSDP axes (data x context) once per call, and then
  sums the reduce-scattered shard over `expert` (a token axis the weight is not split on) once."""
  mesh = make_mesh(AXES)
  _, text = _run(mesh, RULES)
  region = [c for c in hc.parse(text, 8, program_dtypes=False) if "lm_head" in c.op_name]
  kinds = {c.kind for c in region}
  assert {"all-gather", "reduce-scatter"} <= kinds <= {"all-gather", "reduce-scatter", "all-reduce"}, kinds
  assert all(c.times == 1 for c in region)
  gathered = sum(c.buffer_bytes for c in region if c.kind == "all-gather")
  assert gathered <= 3 * D * V * 4              # the weight (and the teacher's, the same weight detached)
  for c in region:
    if c.kind != "all-gather":
      assert c.group_size == (4 if c.kind == "reduce-scatter" else 2), (c.kind, c.group_size)
  # The sum over `expert` runs on the reduce-scattered quarter of each gradient (two losses, two weight gradients),
  # not on the full [D, V] f32 gradient (before: 2 x D x V x 4 bytes, the whole gradient across `expert`).
  assert sum(c.buffer_bytes for c in region if c.kind == "all-reduce") == 2 * D * V * 4 // 4


def test_no_mesh_runs_the_plain_head():
  """Without a mesh the per-device wrapper is not used (no shard_map in the program)."""
  h, w, t, _ = _inputs()
  text = jax.jit(lambda h, w: head.token_logprobs(h, w, t)).lower(h, w).as_text()
  assert "shard_map" not in text and "sdy.manual_computation" not in text
