"""Two real processes (gloo CPU collectives, a loopback coordinator) train exactly like one process.

Each process feeds only its half of every global batch; the mesh (all devices on `data`) spans both processes. The
reference is the same trainer in this test process on as many fake devices as the two processes have together.
The default case gives each process one device (compiles stay small); the slow one four (data=8).

Tolerance: both compute the same float32 math on the same device layout, but reduce across processes through gloo
in another order (~1e-7 relative); test_mesh_training.py says why three AdamW steps keep that below 1e-5 in losses
and 1e-4 in params.
"""
import os
import subprocess
import sys

import jax
import net_testlib
import numpy as np
import pytest
from mesh_testlib import logged, train

from composer_jax.parallel import distributed
from composer_jax.parallel import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def _run_processes(workdir: str, n: int, devices_each: int, timeout: float = 420):
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_each}", "PYTHONPATH": ROOT}
  coordinator = f"127.0.0.1:{net_testlib.free_port()}"
  procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "mesh_testlib.py"), workdir, str(STEPS),
                             coordinator, str(n), str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(n)]
  outs = net_testlib.communicate_all(procs, timeout)
  for i, (rc, out, _) in enumerate(outs):
    assert rc == 0, f"process {i} failed:\n{out[-4000:]}"
  return [out for _, out, _ in outs]


@pytest.mark.parametrize("devices_each", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_two_processes_match_one_process(tmp_path, devices_each):
  mp_dir, ref_dir = str(tmp_path / "mp"), str(tmp_path / "ref")
  outs = _run_processes(mp_dir, n=2, devices_each=devices_each)
  for i in range(2):
    assert f"process {i}/2: {2 * devices_each} devices, done" in outs[i]
  cfg = mesh_lib.MeshConfig(data=2 * devices_each)
  ref_params, _ = train(ref_dir, STEPS, mesh_lib.mesh_from_config(cfg), cfg.rules())
  ref_rows, rows = logged(ref_dir), logged(mp_dir)
  assert sorted(rows) == list(range(1, STEPS + 1))   # only process 0 wrote metrics (one row per step)
  for step in rows:
    for key in ("loss", "ce", "mtp1_loss", "grad_norm"):
      np.testing.assert_allclose(rows[step][key], ref_rows[step][key], rtol=1e-5, err_msg=f"{key} at step {step}")
    assert rows[step]["target_tokens"] == ref_rows[step]["target_tokens"]
  np.testing.assert_allclose(rows[STEPS]["eval_loss"], ref_rows[STEPS]["eval_loss"], rtol=1e-5)
  ref = {jax.tree_util.keystr(k): np.asarray(v)
         for k, v in jax.tree_util.tree_flatten_with_path(jax.device_get(ref_params))[0]}
  for i in range(2):
    got = np.load(os.path.join(mp_dir, f"params_{i}.npz"))
    assert sorted(got.files) == sorted(ref)
    for k in ref:
      np.testing.assert_allclose(got[k], ref[k], atol=1e-5, rtol=1e-4, err_msg=f"process {i} param {k}")
  # Both processes took part in one orbax checkpoint (one step directory, a data-iterator file per process).
  ckpt = os.path.join(mp_dir, "checkpoints", str(STEPS))
  assert sorted(f for f in os.listdir(os.path.join(ckpt, "data")) if f.startswith("process_")) == [
      "process_0-of-2.json", "process_1-of-2.json"]


def test_distributed_config_from_flags_and_environment(monkeypatch):
  assert not distributed.DistributedConfig().enabled   # single process: initialize is a no-op
  with pytest.raises(ValueError, match="coordinator_address"):
    distributed.DistributedConfig(num_processes=2, process_id=1)
  with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
    distributed.DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=2)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  cfg = distributed.DistributedConfig.from_env(process_id=2, num_processes=None)   # a flag overrides, None does not
  assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.enabled) == ("10.0.0.1:1234", 4, 2, True)
