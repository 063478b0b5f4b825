"""The prepared GPU check: the shell script parses and installs what the project pins; its CPU-runnable parts run."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gpu_check():
  spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_script_parses_and_installs_the_pinned_cuda_jax():
  subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)
  text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
  assert '-e "$ROOT[gpu]"' in text and "benchmarks/gpu_check.py" in text and "-m gpu" in text
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  jax_pin = next(d for d in project["dependencies"] if d.startswith("jax=="))
  assert f"jax[cuda12]=={jax_pin.split('==')[1]}" in project["optional-dependencies"]["gpu"]


def test_refuses_to_time_without_a_gpu(capsys):
  with pytest.raises(SystemExit, match="no GPU"):
    _gpu_check().main([])


def test_dry_ep_ragged_matches_the_dense_reference(capsys):
  res = _gpu_check().main(["--dry", "--only", "ep_ragged"])
  assert res["ep_ragged"]["ok"] and res["ep_ragged"]["reference_abs_mean"] > 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ep_ragged"]["ok"]


@pytest.mark.slow
def test_dry_run_of_every_section():
  """All CPU-runnable parts in a fresh process (interpret-mode kernels, tiny model): ~4 min on a busy 2-core CPU."""
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry", "--steps", "2",
                        "--repeats", "1"], capture_output=True, text=True, timeout=1200, check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  res = json.loads(out.stdout.strip().splitlines()[-1])
  assert res["all_ok"] and res["dry"]
  assert all(res["kernels"][f]["ok"] for f in ("bf16", "mxfp8", "nvfp4"))
  assert res["train_small"]["tokens_per_s"] > 0 and res["decode"]["decode_tokens_per_s_b32"] > 0
  assert res["decode"]["mtp_heads"] == "random" and res["grouped_matmul"]["measured"] is False
  assert res["decode"]["adaptive_k_b1"] in (0, 1, 2) and res["decode"]["adaptive_tokens_per_forward_b1"] >= 1


def test_scale_plan_gpu_compile_env_mocks_the_topology():
  """`scale_plan.py --platform gpu` (what gpu_check.sh runs) compiles on a mocked 8-GPUs-per-host topology; the CPU
  plan keeps its fake devices. Only the environment is checkable here (no GPU)."""
  from benchmarks import scale_plan as sp
  env = sp.child_env(64, "gpu", "/tmp/d")
  assert env["JAX_MOCK_GPU_TOPOLOGY"] == "1x8x8" and env["JAX_PLATFORMS"] == "cuda"
  assert "--xla_dump_to=/tmp/d" in env["XLA_FLAGS"] and "host_platform_device_count" not in env["XLA_FLAGS"]
  assert "--xla_force_host_platform_device_count=64" in sp.child_env(64, "cpu", "/tmp/d")["XLA_FLAGS"]
  with pytest.raises(ValueError, match="multiple"):
    sp.child_env(12, "gpu", "/tmp/d")
  assert "scale_plan.py --platform gpu" in (ROOT / "benchmarks" / "gpu_check.sh").read_text()
