"""`experiments/rl_main.py` as two real processes (gloo CPU collectives, a loopback coordinator): the whole run —
workdir claim, oracle demonstrations, SFT warm start, sync RL, weight files, held-out evaluations — like one process
on as many devices; and bad input stops every process with the same one line.

Tolerance: the two runs compute the same float32 math on the same device layout (data=2), but reduce across
processes through gloo in another order (~1e-7 relative, as `test_multiprocess.py`), and process 0 rolls out and
evaluates with a replica of the gathered params on its own device where one process uses the params as the mesh
holds them. The rollouts are the same tokens (equal rewards, equal evaluation counts); losses, KL and gradient norms
agree to 1e-5 relative, 1e-6 absolute (the KL near zero is a difference of logprobs near 4, so ~1e-8 absolute apart).
"""
import json
import os
import subprocess
import sys

import net_testlib
import numpy as np
import pytest
from workdir_testlib import live_lock_holder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=experiments/configs/rl.py:test,mode=sync"


def _start(workdir, devices: int, *args) -> subprocess.Popen:
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "PYTHONPATH": ROOT,
         "JAX_PLATFORMS": "cpu"}
  return subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "rl_main.py"), CONFIG,
                           f"--workdir={workdir}", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _two_processes(workdir, *args) -> list[tuple[int, str, str]]:
  coordinator = f"127.0.0.1:{net_testlib.free_port()}"
  procs = [_start(workdir, 1, "--config.mesh.data=-1", f"--coordinator_address={coordinator}", "--num_processes=2",
                  f"--process_id={i}", *args) for i in range(2)]
  return _finish(procs)


def _finish(procs, timeout: float = 1200) -> list[tuple[int, str, str]]:
  return net_testlib.communicate_all(procs, timeout)


def _jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_bad_input_stops_every_process_with_the_same_line(tmp_path):
  """Process 0 finds the workdir in use (its claim); process 1, waiting for that claim, raises the same error."""
  with live_lock_holder(tmp_path) as holder:
    outs = _two_processes(tmp_path)
  for i, (rc, _, err) in enumerate(outs):
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("[Gloo]")]
    assert rc == 2 and "Traceback" not in err, (i, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and (
        f"workdir {tmp_path} is in use by a live run (pid {holder.pid} on ") in lines[0], (i, err[-3000:])
  assert "process 0 failed at claim: WorkdirError" in outs[1][2]


@pytest.mark.slow   # two SFT + RL runs of rl.py:test: 105 s on 2 cores at load 3, ~9 min at load 8
def test_rl_main_as_two_processes_runs_like_one_process(tmp_path):
  mp, ref = str(tmp_path / "mp"), str(tmp_path / "ref")
  outs = _two_processes(mp)
  for i, (rc, _, err) in enumerate(outs):
    assert rc == 0, (i, err[-4000:])
  (ref_rc, ref_out, ref_err), = _finish([_start(ref, 2, "--config.mesh.data=2")])
  assert ref_rc == 0, ref_err[-4000:]
  with open(os.path.join(mp, "results.json")) as f:
    result = json.load(f)
  assert json.loads(outs[0][1].splitlines()[-1]) == result    # process 0 reports the run
  assert not [x for x in outs[1][1].splitlines() if x.strip() and not x.startswith("[Gloo]")]   # process 1: nothing
  with open(os.path.join(ref, "results.json")) as f:
    want = json.load(f)
  for row in ("sft", "rl"):   # the same evaluation episodes: process 0's replica decodes what the mesh decodes
    assert result[row] == want[row], row
  # Process 0 alone wrote the applied log and the metrics: each step once, each group once.
  applied = _jsonl(os.path.join(mp, "applied.jsonl"))
  assert [r["step"] for r in applied] == [1, 2, 3, 4]
  keys = [k for r in applied for k in r["keys"]]
  assert len(keys) == len(set(keys)) == 4 * 2
  for name in ("sft/metrics.jsonl", "metrics.jsonl"):
    got, exp = _jsonl(os.path.join(mp, name)), _jsonl(os.path.join(ref, name))
    assert [r["step"] for r in got] == [r["step"] for r in exp], name
    for g, e in zip(got, exp, strict=True):
      for k in ("loss", "kl", "grad_norm", "eval_loss"):
        if k in e:
          np.testing.assert_allclose(g[k], e[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {k} at step {e['step']}")
      for k in ("reward", "pass_rate", "length"):
        if k in e:
          assert g[k] == e[k], f"{name} {k} at step {e['step']}"
  # The final policy's weight file, gathered from both processes.
  with np.load(os.path.join(mp, "weights", "v4.npz")) as g, np.load(os.path.join(ref, "weights", "v4.npz")) as e:
    assert sorted(g.files) == sorted(e.files)
    for k in e.files:
      np.testing.assert_allclose(g[k], e[k], rtol=1e-5, atol=1e-6, err_msg=k)
