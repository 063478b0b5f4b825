"""The RL trainer across real processes and through a SIGKILL on a mesh: the same run as one uninterrupted process.

Both run the trainer on a queue of fixed groups (`rl_mesh_testlib`): process 0 polls each step's groups and the
others receive their keys (`rl.processes.share_groups`), read them and place their own rows.

Tolerance (two processes): the same float32 math on the same device layout, reduced across processes through gloo
in another order (~1e-7 relative), as `test_multiprocess.py`; test_rl_mesh.py says why four RL steps keep that within
1e-5. A resumed run on the same mesh runs the same compiled program on the same inputs: exactly equal.
"""
import os
import subprocess
import sys

import net_testlib
import numpy as np
import pytest
import rl_mesh_testlib as lib

from composer_jax.parallel import mesh as mesh_lib
from rollout.queue import GroupKey

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4


def _start(workdir: str, kill_at: int, coordinator: str, n: int, i: int, devices: int) -> subprocess.Popen:
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "PYTHONPATH": ROOT}
  return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "rl_mesh_testlib.py"), workdir, str(STEPS),
                           str(kill_at), coordinator, str(n), str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _finish(procs, timeout: float = 600) -> list[tuple[int, str]]:
  return [(rc, out) for rc, out, _ in net_testlib.communicate_all(procs, timeout)]


def _params(path: str) -> dict:
  with np.load(path) as z:
    return dict(z)


def _applied_once(workdir: str) -> list[int]:
  """Each step once in the applied log, each group once and in queue order; returns each group's policy version
  (the step `fill_queue` wrote it for, so each step trained on its own groups)."""
  rows = lib.applied(workdir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  keys = [GroupKey.parse(k) for r in rows for k in r["keys"]]
  assert len(keys) == len(set(keys)) == STEPS * 2
  assert [k.t_ns for k in keys] == sorted(k.t_ns for k in keys)
  return [k.version for k in keys]


@pytest.mark.slow   # ~3 compiles of the RL step; 15 min at load 27 here
def test_two_processes_train_like_one(tmp_path):
  mp_dir, ref_dir = str(tmp_path / "mp"), str(tmp_path / "ref")
  for d in (mp_dir, ref_dir):
    lib.fill_queue(lib.run_config(d, STEPS), STEPS)
  coordinator = f"127.0.0.1:{net_testlib.free_port()}"
  outs = _finish([_start(mp_dir, 0, coordinator, 2, i, devices=1) for i in range(2)])
  for i, (rc, out) in enumerate(outs):
    assert rc == 0 and f"process {i}/2: 2 devices, done" in out, out[-4000:]
  ref = lib.train(ref_dir, STEPS, mesh_lib.mesh_from_config(mesh_lib.MeshConfig(data=2)),
                  mesh_lib.MeshConfig(data=2).rules())
  lib.save_params(ref, os.path.join(ref_dir, "params_0.npz"))
  assert _applied_once(mp_dir) == _applied_once(ref_dir) == [0, 0, 1, 1, 2, 2, 3, 3]   # process 0 alone wrote it
  got, want = lib.steps_logged(mp_dir), lib.steps_logged(ref_dir)
  for step in range(1, STEPS + 1):
    for k in ("loss", "kl", "grad_norm", "logprob_gap_replay", "reward"):
      np.testing.assert_allclose(got[step][k], want[step][k], rtol=1e-5, atol=1e-6, err_msg=f"{k} at step {step}")
  want_p = _params(os.path.join(ref_dir, "params_0.npz"))
  for i in range(2):
    got_p = _params(os.path.join(mp_dir, f"params_{i}.npz"))
    for k in want_p:
      np.testing.assert_allclose(got_p[k], want_p[k], rtol=1e-5, atol=1e-6, err_msg=f"process {i} param {k}")


@pytest.mark.slow
def test_sigkill_and_resume_on_a_mesh_continue_the_run_exactly(tmp_path):
  """On data=2 x expert=2 x context=2: killed after step 3 was trained and logged but before its checkpoint, the
  rerun resumes from step 2's checkpoint, drops step 3 from the applied log, is handed step 3's groups again and
  ends where an uninterrupted run ends."""
  killed, ref_dir = str(tmp_path / "killed"), str(tmp_path / "ref")
  for d in (killed, ref_dir):
    lib.fill_queue(lib.run_config(d, STEPS), STEPS)
  (rc, out), = _finish([_start(killed, 3, "-", 1, 0, devices=8)])
  assert rc == -9, out[-4000:]
  assert [r["step"] for r in lib.applied(killed)] == [1, 2, 3]       # step 3 applied, then the kill
  (rc, out), (ref_rc, ref_out) = _finish([_start(killed, 0, "-", 1, 0, devices=8),
                                          _start(ref_dir, 0, "-", 1, 0, devices=8)])
  assert rc == 0 and ref_rc == 0, (out[-4000:], ref_out[-4000:])
  assert _applied_once(killed) == _applied_once(ref_dir) == [0, 0, 1, 1, 2, 2, 3, 3]
  got, want = lib.steps_logged(killed), lib.steps_logged(ref_dir)
  for step in range(1, STEPS + 1):
    assert got[step]["loss"] == want[step]["loss"] and got[step]["grad_norm"] == want[step]["grad_norm"], step
  want_p = _params(os.path.join(ref_dir, "params_0.npz"))
  got_p = _params(os.path.join(killed, "params_0.npz"))
  for k in want_p:
    np.testing.assert_array_equal(got_p[k], want_p[k], err_msg=k)
