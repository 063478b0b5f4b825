"""Sliced loading: each process reads only the blocks its devices hold, and the result equals the full load bit for bit.

On 8 fake devices (one process) every device block is read alone and must cost exactly its own bytes; the whole
load reads every stored byte once however the mesh replicates. Two real processes (gloo, loopback coordinator) with
experts split across them read exactly their share, and save the checkpoint back together.
"""
import functools
import json
import math
import os
import subprocess
import sys

import jax
import net_testlib
import numpy as np
import pytest
from hf_sliced_testlib import CFG
from safetensors.numpy import load_file

from composer_jax.interop import hf, hf_files
from composer_jax.interop.hf_names import leaf_paths, mtp_copies, read_block, sources
from composer_jax.model import init, shardings
from composer_jax.parallel.mesh import make_mesh
from composer_jax.parallel.rules import ShardingRules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _params():
  p = jax.device_get(init(jax.random.key(0), CFG))
  p["moe_layers"]["moe"]["bias"] = np.random.default_rng(1).normal(size=p["moe_layers"]["moe"]["bias"].shape)
  p["moe_layers"]["moe"]["bias"] = p["moe_layers"]["moe"]["bias"].astype(np.float32)
  return p


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("sliced")
  plain, fp8 = str(root / "plain"), str(root / "fp8")
  hf.save(plain, CFG, _params(), max_shard_bytes=30_000)   # several files
  hf.save(fp8, CFG, _params(), fp8=True, fp8_block=(16, 16))   # small blocks: reads cut them at many edges
  return plain, fp8


def _stored_bytes(path: str, skip=()) -> int:
  files = hf_files.tensor_files(path)
  total = 0
  for file in set(files.values()):
    total += sum(v.nbytes for k, v in load_file(file).items() if k not in skip)
  return total


def _assert_equal_trees(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("mesh_axes,rules", [
    ({"data": 2, "expert": 2, "tensor": 2}, ShardingRules()),
    ({"data": 8}, ShardingRules()),
    # Heads and head_dim both on tensor-like axes: k_b / v_b blocks cut kv_b_proj inside each head.
    ({"data": 2, "tensor": 4}, ShardingRules(heads=None, head_dim="tensor", kv_lora="data", embed=None)),
])
def test_sliced_load_on_8_devices_equals_the_full_load(ckpts, mesh_axes, rules):
  plain, fp8 = ckpts
  mesh = make_mesh(mesh_axes)
  cfg, params, stats = hf.load_with_stats(plain, mesh=mesh, rules=rules)
  _assert_equal_trees(params, _params())
  want = shardings(cfg, mesh, rules)
  jax.tree.map(lambda x, s: (x.sharding == s) or pytest.fail(f"{x.sharding} != {s}"), params, want)
  # One process holding every device reads each stored byte exactly once (the MTP embed/head copies never).
  assert stats.bytes_read == _stored_bytes(plain, skip=set(mtp_copies(cfg)))
  _, p8, s8 = hf.load_with_stats(fp8, mesh=mesh, rules=rules)
  _, p8_full = hf.load(fp8)
  _assert_equal_trees(p8, p8_full)
  scales = _stored_bytes(fp8) - _stored_bytes(fp8, skip=[k for k in hf_files.tensor_files(fp8)
                                                         if k.endswith("_scale_inv")])
  weights_once = _stored_bytes(fp8, skip=set(mtp_copies(cfg))) - scales
  # FP8 weights once; a scale block is re-read by each region it covers (per head, per device block).
  assert weights_once <= s8.bytes_read - scales <= weights_once + 8 * scales


def test_every_device_block_reads_exactly_its_bytes(ckpts):
  """Each block a device holds, read alone, costs exactly its own elements x 4 bytes — experts only where they live."""
  plain, _ = ckpts
  mesh = make_mesh({"data": 2, "expert": 2, "tensor": 2})
  where = hf_files.tensor_files(plain)
  srcs, full = sources(CFG), leaf_paths(_params())
  for path, s in leaf_paths(shardings(CFG, mesh)).items():
    for idx in set(tuple(i.indices(n)[:2] for i, n in zip(ix, full[path].shape))
                   for ix in s.devices_indices_map(full[path].shape).values()):
      ckpt = hf_files.Checkpoint(where)
      block = read_block(srcs[path], idx, ckpt.region)
      np.testing.assert_array_equal(block, full[path][tuple(slice(a, b) for a, b in idx)])
      assert ckpt.bytes_read == 4 * math.prod(b - a for a, b in idx), (path, idx)


def test_two_processes_read_their_share_and_save_together(ckpts, tmp_path):
  plain, fp8 = ckpts
  out = str(tmp_path / "out")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": ROOT}
  coordinator = f"127.0.0.1:{net_testlib.free_port()}"
  procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "hf_sliced_testlib.py"), plain, fp8, out,
                             coordinator, "2", str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  for i, (rc, o, _) in enumerate(net_testlib.communicate_all(procs, timeout=300)):
    assert rc == 0, f"process {i} failed:\n{o[-4000:]}"
  records = [json.load(open(os.path.join(out, f"process_{i}.json"))) for i in range(2)]
  copies = _stored_bytes(plain) - _stored_bytes(plain, skip=set(mtp_copies(CFG)))
  all_bytes = _stored_bytes(plain) - copies
  n_expert_layers = CFG.num_hidden_layers - CFG.first_k_dense_replace + CFG.num_nextn_predict_layers
  expert_bytes = 4 * 3 * n_expert_layers * CFG.n_routed_experts * CFG.hidden_size * CFG.moe_intermediate_size
  for r in records:
    assert r["devices"] == 4
    # Exactly its share: everything but the experts (tensor=2 lies within a process), half of the experts.
    assert r["plain"]["bytes_read"] == sum(r["plain"]["share"].values())
    assert r["plain"]["share"]["experts"] == expert_bytes // 2
    assert r["plain"]["bytes_read"] == all_bytes - expert_bytes // 2
    share8 = sum(r["fp8"]["share"].values())
    assert share8 <= r["fp8"]["bytes_read"] <= share8 + 8 * (_stored_bytes(fp8) - _stored_bytes(
        fp8, skip=[k for k in hf_files.tensor_files(fp8) if k.endswith("_scale_inv")]))
  # Each process's blocks equal the same blocks of the full load, bit for bit.
  full = {"plain": leaf_paths(_params()), "fp8": leaf_paths(hf.load(fp8)[1])}
  seen_experts = set()
  for i in range(2):
    for key, block in np.load(os.path.join(out, f"blocks_{i}.npz")).items():
      kind, leaf, index = key.split("|")
      sl = tuple(slice(*(int(v) if v != "None" else None for v in part.split(":"))) for part in index.split(","))
      np.testing.assert_array_equal(block, np.asarray(full[kind][tuple(leaf.split("/"))])[sl], err_msg=key)
      if kind == "plain" and leaf == "moe_layers/moe/gate":
        seen_experts.add((i, sl[1].start))
  assert {e for _, e in seen_experts} == {0, 2} and len(seen_experts) == 2   # each process one half, not both
  # Saved from both processes, each writing its own files: expert e only by the process holding it, with no
  # gathering; from the FSDP mesh (every weight split across the processes) by gathering. Both load back bit-exactly.
  for saved, key in (("saved", "wrote"), ("saved_fsdp", "wrote_fsdp")):
    index = json.load(open(os.path.join(out, saved, hf.INDEX_FILE)))
    assert sorted(records[0][key] + records[1][key]) == sorted(set(index["weight_map"].values()))
    assert records[0][key] and records[1][key]
    cfg, params = hf.load(os.path.join(out, saved))
    assert cfg.num_nextn_predict_layers == CFG.num_nextn_predict_layers
    _assert_equal_trees(params, _params())
  index = json.load(open(os.path.join(out, "saved", hf.INDEX_FILE)))["weight_map"]
  assert records[0]["gathered"] == 0 and records[0]["gathered_fsdp"] > 0   # FSDP splits every embed dim
  for i, r in enumerate(records):
    experts = {int(n.split(".")[5]) for n, f in index.items() if f in r["wrote"] and ".experts." in n}
    assert experts == {2 * i, 2 * i + 1}, (i, experts)


def test_host_memory_arithmetic_matches_real_shardings():
  """benchmarks/checkpoint_host_memory.py's per-host sums equal the distinct blocks of real NamedShardings, with
  hosts taken as consecutive groups of 4 of the 8 fake devices."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("chm", os.path.join(ROOT, "benchmarks", "checkpoint_host_memory.py"))
  chm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(chm)
  sizes = {"data": 2, "expert": 2, "context": 1, "tensor": 2}
  rules = ShardingRules()
  got = chm.per_host(CFG, sizes, 2, rules)["mem"]
  mesh = make_mesh({k: v for k, v in sizes.items() if v > 1})
  want = np.zeros(2)
  for path, s in leaf_paths(shardings(CFG, mesh, rules)).items():
    aval = leaf_paths(jax.eval_shape(lambda: init(jax.random.key(0), CFG)))[path]
    for h in range(2):
      blocks = {tuple(i.indices(n)[:2] for i, n in zip(ix, aval.shape))
                for d, ix in s.devices_indices_map(aval.shape).items() if d.id // 4 == h}
      want[h] += sum(math.prod(b - a for a, b in blk) for blk in blocks) * aval.dtype.itemsize
  np.testing.assert_array_equal(got, want)
  assert got[0] < sum(math.prod(a.shape) * 4 for a in jax.tree.leaves(_params()))   # a real saving


def test_host_memory_script_prints_the_kimi_figures():
  r = subprocess.run([sys.executable, "benchmarks/checkpoint_host_memory.py"], cwd=ROOT, capture_output=True,
                     text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["total_params"] > 1.0e12 and out["full_copy_gb_per_host"] > 2000
  # expert=32 over 32 hosts: 1/32 of the experts + every non-expert weight per host.
  assert 60 < out["sliced_params_gb_per_host"] < 100 and out["sliced_fp8_read_gb_per_host"] < 50
