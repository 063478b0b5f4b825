"""The scale plan's method, checked where it can be: hand-computed collectives (bf16 tuples included), FLOPs of
hand-built programs (peak buffers: test_scale_plan_memory.py), the roofline, temp flat in depth under scan, and on
8 fake devices the compiled figures against `benchmarks/ep_bytes.py`, `benchmarks/cp_memory.py` and a real run of
the same step."""
import dataclasses
import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks import hlo_collectives as hc
from benchmarks import hlo_costs, hlo_module
from benchmarks import scale_plan_cases as sp
from benchmarks import scale_plan_roofline as spr
from composer_jax.parallel import make_mesh

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench(name):
  spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_collectives_hand_computed_with_loops_groups_and_nodes():
  """ppermute x5 in a fori_loop, an all-gather over expert, a psum over data: bytes, counts, links by hand."""
  mesh = make_mesh({"data": 2, "expert": 4})
  ring = [(j, (j + 1) % 4) for j in range(4)]

  def body(x_16x32):
    y = jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.ppermute(c, "expert", ring) * 1.5, x_16x32)
    return jax.lax.psum(jax.lax.all_gather(y, "expert", tiled=True), "data")
  f = jax.shard_map(body, mesh=mesh, in_specs=P(("data", "expert")), out_specs=P("expert"))
  text = jax.jit(f).lower(jax.ShapeDtypeStruct((8 * 16, 32), jnp.float32)).compile().as_text()
  assert " while(" in text                      # the loop stays a loop: its trip count must be applied
  # Nodes of 4 devices: expert groups {0..3}, {4..7} stay inside one; data pairs {i, i+4} cross nodes.
  s = hc.summarize(hc.parse(text, n_devices=8, devices_per_node=4))
  shard = 16 * 32 * 4
  assert s["collective-permute"] == {"count": 5, "buffer_bytes": 5 * shard, "nvlink_bytes": 5 * shard,
                                     "ib_bytes": 0.0}
  assert s["all-gather"] == {"count": 1, "buffer_bytes": 4 * shard, "nvlink_bytes": 3 * shard, "ib_bytes": 0.0}
  assert s["all-reduce"] == {"count": 1, "buffer_bytes": 4 * shard, "nvlink_bytes": 0.0,
                             "ib_bytes": 2 * 0.5 * 4 * shard}
  # With 8 devices per node every group is inside the node.
  s8 = hc.summarize(hc.parse(text, n_devices=8, devices_per_node=8))
  assert s8["all-reduce"]["ib_bytes"] == 0.0 and s8["all-reduce"]["nvlink_bytes"] == 4 * shard


def test_replica_group_formats():
  line = ("x = f32[4]{0} all-reduce(y), replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) "
          "{'axis_0'}, to_apply=%r")
  # ids = arange(8).reshape(4,2).T = [[0,2,4,6],[1,3,5,7]]; groups vary axis_0 (size 2) with axis_1 fixed.
  assert hc.replica_groups(line, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert hc.replica_groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert hc.replica_groups("replica_groups=[2,4]<=[4,2]T(1,0)", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert hc.replica_groups("replica_groups={{0,3},{1,2}}", 4) == [[0, 3], [1, 2]]
  with pytest.raises(ValueError, match="cannot parse"):
    hc.replica_groups("replica_groups=<<weird>>", 8)


def test_roofline_by_hand():
  """Compute-, memory- and comm-bound times and the MFU bound for made-up per-device figures."""
  cfg = sp.plan_model_config("kimi_k2", 4096)
  from composer_jax import model
  _, active = model.count_params(cfg)
  assert sp.model_flops_per_token(cfg, 4096) == 2 * active + 61 * 2 * 64 * (192 + 128) * 4096 / 2
  c = {k: {"nvlink_bytes": 0.0, "ib_bytes": 0.0} for k in hc.KINDS}
  c["all-to-all"]["ib_bytes"] = 100e9
  c["all-gather"]["nvlink_bytes"] = 45e9
  row = {"tokens": 4096, "argument": 50e9, "output": 50e9, "temp": 30e9, "alias": 50e9, "collectives": c,
         "hlo_flops": 1.5e15, "model_flops": 1e15, "peak": {"cpu_only_bytes": 10e9}}
  r = spr.summarize_case(row)
  assert r["temp_gpu"] == 20e9 and r["total_gpu"] == 50e9 + 20e9 and r["fits"]
  assert r["t"]["compute"] == pytest.approx(1.5e15 / 989e12)
  assert r["t"]["memory"] == pytest.approx(140e9 / 4.8e12)
  assert r["t"]["comm"] == pytest.approx(100e9 / 50e9 + 45e9 / 450e9) and r["limit"] == "comm"
  assert r["mfu_bound"] == pytest.approx(1e15 / (2.1 * 989e12)) and r["flops_ratio"] == 1.5


def test_bf16_collectives_are_counted_in_bf16_tuples_included():
  """XLA:CPU widens bf16 collectives to f32 and emits the all-to-all as a tuple of per-peer pieces and the two psums
  as one combined all-reduce; each piece is counted in the dtype the program has (bf16 here, f32 for the f32 psum)."""
  mesh = make_mesh({"expert": 4}, devices=jax.devices()[:4])

  def body(x_bf16, y_f32):
    z = jax.lax.all_to_all(x_bf16, "expert", 0, 0, tiled=True)
    return z, jax.lax.psum(x_bf16, "expert"), jax.lax.psum(y_f32, "expert")
  f = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"), P("expert")), out_specs=(P("expert"), P(), P()))
  x = jax.ShapeDtypeStruct((4 * 8, 16), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((4 * 8, 16), jnp.float32)
  text = jax.jit(f).lower(x, y).compile().as_text()
  widened = hc.summarize(hc.parse(text, 4, program_dtypes=False))
  s = hc.summarize(hc.parse(text, 4))
  shard = 8 * 16                                     # elements per device
  assert s["all-to-all"]["buffer_bytes"] == 2 * shard and widened["all-to-all"]["buffer_bytes"] == 4 * shard
  assert s["all-reduce"]["buffer_bytes"] == 2 * shard + 4 * shard      # the bf16 psum + the f32 psum
  assert widened["all-reduce"]["buffer_bytes"] == 8 * shard
  assert any(" all-to-all(" in line and line.split("=")[1].strip().startswith("(") for line in text.splitlines())


def test_dot_flops_count_every_loop_iteration():
  """10 scanned [128, 256] x [256, 256] matmuls: XLA's cost_analysis counts the loop body once, dot_flops 10 times."""
  def f(x, w):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]
  compiled = jax.jit(f).lower(jnp.ones((128, 256)), jnp.ones((10, 256, 256))).compile()
  one = 2 * 128 * 256 * 256
  assert compiled.cost_analysis()["flops"] < 2 * one
  assert hlo_costs.dot_flops(hlo_module.parse_module(compiled.as_text()))["total"] == 10 * one


# A matmul XLA:CPU fused into a library call whose ops and call carry no op_name (as in the Kimi K2 step's attention
# projections): its source is found through the call's operand.
UNNAMED_DOT = """HloModule m
%fused (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,2]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={}
}

ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  %x = f32[4,8]{1,0} tanh(%a), metadata={op_name="jit(f)/attention/tanh"}
  ROOT %f = f32[4,2]{1,0} fusion(%x, %b), kind=kCustom, calls=%fused, metadata={stack_frame_id=3}
}
"""


def test_a_fused_matmul_without_a_name_takes_its_callers_source():
  flops = hlo_costs.dot_flops(hlo_module.parse_module(UNNAMED_DOT))
  assert flops == {"total": 2 * 4 * 2 * 8, "by_scope": {"attention": 2 * 4 * 2 * 8}}



def test_a_conditional_counts_only_its_heaviest_branch():
  """5 scanned steps, each a `lax.cond` between one and two [128, 256] x [256, 256] matmuls: one branch runs per
  step, so 5 x 2 matmuls are counted (every branch would give 5 x 3); a cond inside a cond likewise."""
  def f(x, w, flags):
    def step(c, xs):
      wi, flag = xs
      two = lambda c: jnp.tanh(jnp.tanh(c @ wi) @ wi)  # noqa: E731
      one = lambda c: jax.lax.cond(flag > 1, lambda c: jnp.tanh(c @ wi), jnp.sin, c)  # noqa: E731
      return jax.lax.cond(flag > 0, two, one, c), None
    return jax.lax.scan(step, x, (w, flags))[0]
  text = jax.jit(f).lower(jnp.ones((128, 256)), jnp.ones((5, 256, 256)), jnp.ones(5, jnp.int32)).compile().as_text()
  assert " conditional(" in text
  assert hlo_costs.dot_flops(hlo_module.parse_module(text))["total"] == 5 * 2 * (2 * 128 * 256 * 256)

def test_moonlight_16b_is_the_published_size():
  """~16B total / ~3B active (Moonlight-16B-A3B: 15.96B / 2.58B without the embedding lookup)."""
  from composer_jax import model
  cfg = sp.plan_model_config("moonlight_16b", 8192)
  total, active = model.count_params(cfg)
  assert 15.5e9 < total < 16.5e9 and 2.3e9 < active < 3.0e9
  assert cfg.num_hidden_layers == 27 and cfg.scan_layers


def test_all_to_all_bytes_match_ep_bytes(monkeypatch):
  """The step's EP all-to-all bytes = (MoE layers + MTP block) x one layer's fwd+bwd bytes from ep_bytes.measure.

  `small` is f32, so XLA:CPU's bf16 upcast plays no part (its FP8 dispatch it widens to f16: the program's types
  are compared); dense attention (no context axis here).
  """
  seq = 128
  orig = sp.plan_model_config
  monkeypatch.setattr(sp, "plan_model_config",
                      lambda v, s, n=None: dataclasses.replace(orig(v, s, n), attention_impl="dense"))
  case = sp.build_case("small", sp.Stage("lm", seq), {"data": 2, "expert": 4}, 1, devices=jax.devices()[:8])
  with jax.set_mesh(case["mesh"]):
    compiled = case["fn"].lower(*case["args"]).compile()
  got = sp.measure(compiled, case, None)
  eb = _bench("ep_bytes")
  layer_cfg = dataclasses.replace(case["cfg"], moe_impl="ep_capacity")
  # ep_bytes' figure from the cuda lowering: the program's element types (XLA:CPU widens the FP8 dispatch to f16).
  per_token_fwd_bwd, _ = eb.measure(layer_cfg, {"data": 2, "expert": 4}, seq, backward=True)
  n_exchanging = 1 + layer_cfg.num_nextn_predict_layers        # one MoE layer + the MTP module's MoE block
  ep = hc.summarize(hc.parse(compiled.as_text(), 8), op_name_contains="ep_capacity")["all-to-all"]
  # Dispatch + return, forward and backward; the plan dispatches in FP8, whose scales take an all-to-all of their own.
  assert layer_cfg.ep_dispatch == "fp8" and ep["count"] == 5 * n_exchanging
  assert ep["buffer_bytes"] == n_exchanging * per_token_fwd_bwd * seq
  assert got["region_collectives"]["all-to-all"] == ep          # the plan's "ours" column is exactly these
  # ep_bytes' own parser agrees on the compiled module's all-to-alls in XLA:CPU's (widened) types; the partitioner
  # adds the embedding's reshards.
  widened = hc.summarize(hc.parse(compiled.as_text(), 8, program_dtypes=False))["all-to-all"]["buffer_bytes"]
  assert eb.hlo_all_to_all_bytes(compiled.as_text()) == widened > got["collectives"]["all-to-all"]["buffer_bytes"]


def test_activation_memory_matches_cp_memory():
  """Ring attention on context=4, tiny model (activations dominate): the whole step's temp (FSDP params, AdamW)
  is cp_memory's grad(loss) temp (params replicated) plus at most the optimizer's temporaries."""
  cm = _bench("cp_memory")
  from composer_jax import model
  seq = 1024
  cfg = sp.plan_model_config("tiny", seq, 1)
  ref = cm.step_memory(cfg, 4, 1, seq)
  got = sp.compile_case("tiny", sp.Stage("lm", seq), {"context": 4}, 1, None, devices=jax.devices()[:4])
  n_params = sum(x.size for x in jax.tree.leaves(model.abstract_params(cfg)))
  # The step holds what grad(loss) holds, plus the optimizer's temporaries: at most 8 f32 copies of the params
  # (gradients, clipping, AdamW's moment updates, the update); it may schedule a little tighter (measured -0.3%).
  assert -0.05 * ref["temp"] <= got["temp"] - ref["temp"] <= 8 * 4 * n_params
  assert got["temp"] > 10 * 4 * n_params              # the comparison is about activations, not params


@pytest.mark.slow
def test_scanned_temp_grows_only_by_each_layers_own_bytes():
  """Under scan with remat, temp is flat in depth up to each layer's own weight-sized buffers (gradients): `small`
  in bf16 on expert=2 x context=4, 2 vs 4 MoE layers. Per added layer temp grew by 13.8 MB while the arguments
  (params + AdamW state) grew by 12.8 MB; unrolled, XLA:CPU added ~156 MB of activations per layer. Slow: two
  compiles (~2 min each on a busy 2-core machine)."""
  orig = sp.plan_model_config

  def bf16(v, s, n=None):
    return dataclasses.replace(orig(v, s, n), param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
  sp.plan_model_config = bf16
  try:
    got = {n: sp.compile_case("small", sp.Stage("lm", 2048), {"expert": 2, "context": 4}, n, None,
                              devices=jax.devices()[:8]) for n in (2, 4)}
  finally:
    sp.plan_model_config = orig
  temp_per_layer = (got[4]["temp"] - got[2]["temp"]) / 2
  args_per_layer = (got[4]["argument"] - got[2]["argument"]) / 2
  assert 0 < args_per_layer and temp_per_layer <= 1.5 * args_per_layer
  assert temp_per_layer < 0.1 * got[2]["temp"]


RUN_STEP = """
import ctypes, json, os, threading, time
import jax
from benchmarks import scale_plan_cases as sp

def rss():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

axes, seq = {"data": 2, "expert": 4}, 512
compiled, state, batch, fig = sp.compile_for_run("small", sp.Stage("lm", seq), axes, 1)
dev0 = jax.devices()[0]
real_args = sum(s.data.nbytes for x in jax.tree.leaves((state, batch)) for s in x.addressable_shards
                if s.device == dev0)
jax.block_until_ready(state)
ctypes.CDLL("libc.so.6").malloc_trim(0)      # hand the compiler's freed heap back, so the run's growth shows
base, peak, done = rss(), [0], threading.Event()
def poll():
  while not done.is_set():
    peak[0] = max(peak[0], rss())
    time.sleep(0.0005)
t = threading.Thread(target=poll)
t.start()
state, metrics = compiled(state, batch)
jax.block_until_ready(metrics)
done.set()
t.join()
real_out = sum(s.data.nbytes for x in jax.tree.leaves((state, metrics)) for s in x.addressable_shards
               if s.device == dev0)
print(json.dumps({"fig": fig, "real_args": real_args, "real_out": real_out, "rss_delta": peak[0] - base,
                  "n_out": len(jax.tree.leaves((state, metrics))), "loss": float(metrics["loss"])}))
"""


@pytest.mark.slow
def test_compiled_memory_matches_a_real_8_device_run():
  """The same executable run for real: per-device argument/output bytes exact, the peak RSS growth of the
  8 devices (one process) close to 8 x temp. Slow: a fresh process compiles and runs `small` (~1-2 min busy)."""
  env = {"PYTHONPATH": str(ROOT), "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "PATH": "/usr/bin:/bin"}
  out = subprocess.run([sys.executable, "-c", RUN_STEP], capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  fig = r["fig"]
  assert r["real_args"] == fig["argument"]             # state + batch on device 0
  # New state + metrics on device 0, and the output tuple's table of 8-byte buffer pointers.
  assert fig["output"] == r["real_out"] + 8 * r["n_out"]
  # Resident memory sampled during the run (after malloc_trim) counts everything the process allocates: the 8
  # devices' temp plus runtime buffers and allocator slack.
  print("rss growth / (8 x temp):", r["rss_delta"] / (8 * fig["temp"]))
  assert 0.9 <= r["rss_delta"] / (8 * fig["temp"]) <= 1.6
  assert jnp.isfinite(r["loss"])


def test_rl_stage_with_router_replay_compiles_on_a_context_mesh():
  """The plan's RL step (router replay on: the unreplayed forward under a `lax.cond`) compiles on expert x context,
  and its ring's ppermutes are counted (the zig-zag permutation and the ring used to stop it with a PartitionId)."""
  assert sp.RL_CONFIG().router_replay
  got = sp.compile_case("tiny", sp.Stage("rl", 64), {"expert": 2, "context": 4}, 1, None, devices=jax.devices()[:8])
  assert got["temp"] > 0 and got["ref_params"] > 0
  assert got["collectives"]["collective-permute"]["count"] > 0
