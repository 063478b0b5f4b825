"""Every entry point answers a mistake with one line `error: ...` (exit 2) before any work, never a traceback: the
mistakes a new user made in their first hour (each was a 39- to 210-line traceback, or an error minutes in)."""
import os
import pickle
import subprocess
import sys

import pytest

from composer_jax import configs
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs
from rollout.tasks import setfile
from tests.workdir_testlib import live_lock_holder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(main, *args, timeout=180):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", main), *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _one_error_line(r, expected: str) -> None:
  lines = [x for x in r.stderr.splitlines() if x.strip()]
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], r.stderr[-3000:]


def _zero_task_set(path):
  setfile.write_set(str(path), {"format": setfile.FORMAT, "name": "empty", "version": "1", "tasks": [],
                                "sha256": setfile.tasks_digest([])})
  return path


RL_CASES = {
    "missing config file": (["--config=experiments/configs/nope.py:colab"],
                            "--config=experiments/configs/nope.py:colab: cannot load it: [Errno 2] No such file"),
    "misspelled key": (["--config=experiments/configs/rl.py:colab", "--config.rl.loss.kl_cof=0.5"],
                       "no key 'kl_cof' (valid keys of config.rl.loss: adv_eps, adv_std, importance, is_cap, kl_coef,"),
    "misspelled key, default config": (["--config.rl.los.kl_coef=0.5"], "no key 'los' (valid keys of config.rl:"),
    "unknown variant": (["--config=experiments/configs/rl.py:colab_typo"], "unknown rl variant 'colab_typo'; valid:"),
    "misspelled mode": (["--config=experiments/configs/rl.py:test,mode=asynch"],
                        "rollout.mode 'asynch' not in ('sync', 'async')"),
    "renamed key": (["--config=experiments/configs/rl.py:test", "--config.train.steps=3"],
                    "--config.train.steps was renamed: it is now rl.steps"),
    "renamed key, derived": (["--config=experiments/configs/rl.py:test", "--config.rl.temperature=0.7"],
                             "--config.rl.temperature was renamed: it is now harness.sampling.temperature"),
    "renamed arg": (["--config=experiments/configs/rl.py:test,backend=local"],
                    "config arg backend was renamed: it is now workspaces"),
    "mined repos that do not exist": (["--config=experiments/configs/rl.py:test,tasks=mined,repos=/nonexistent"],
                                      "cannot load the 'mined' task source: '/nonexistent' is not a directory"),
}


@pytest.mark.parametrize("case", sorted(RL_CASES))
def test_rl_main_mistakes_are_one_line(case, tmp_path):
  args, expected = RL_CASES[case]
  _one_error_line(_run("rl_main.py", *args, f"--workdir={tmp_path / 'run'}"), expected)
  assert not (tmp_path / "run" / "sft").exists()   # nothing started


def test_rl_main_bad_task_files_and_workdirs_are_one_line(tmp_path):
  (tmp_path / "empty.json").write_text("")
  (tmp_path / "bad.jsonl").write_text('{"instance_id": "a"\n')
  (tmp_path / "a_file").write_text("")
  test = "--config=experiments/configs/rl.py:test"
  cases = [
      ([f"{test},tasks=file,set_file={tmp_path / 'empty.json'}"], "cannot load the 'file' task source: "
       f"{tmp_path / 'empty.json'}: not JSON"),
      ([f"{test},tasks=file,set_file={_zero_task_set(tmp_path / 'zero.json')}"], "has no training tasks"),
      ([f"{test},tasks=swe,jsonl={tmp_path / 'bad.jsonl'},repos_dir={tmp_path}"], "bad.jsonl:1: not valid JSON"),
  ]
  for i, (args, expected) in enumerate(cases):
    _one_error_line(_run("rl_main.py", *args, f"--workdir={tmp_path / f'run{i}'}"), expected)
  _one_error_line(_run("rl_main.py", test, f"--workdir={tmp_path / 'a_file'}"),
                  f"workdir {tmp_path / 'a_file'} is a file, not a directory")


def test_rl_main_refuses_a_resume_with_another_config_and_names_the_override(tmp_path):
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("test"), workdir=str(tmp_path))
  with open(tmp_path / "run_config.pkl", "wb") as f:
    pickle.dump(cfg, f)
  r = _run("rl_main.py", "--config=experiments/configs/rl.py:test", "--config.rl.loss.kl_coef=0.5",
           f"--workdir={tmp_path}")
  _one_error_line(r, "another config (rl.loss.kl_coef 0.001 -> 0.5): pass another --workdir, or, if the change is "
                     "meant (e.g. rl.steps to grow the run), resume with --resume_with_changes=rl.loss.kl_coef")


def test_rl_main_stops_at_once_when_the_workdir_is_in_use(tmp_path):
  with live_lock_holder(tmp_path) as holder:
    r = _run("rl_main.py", "--config=experiments/configs/rl.py:test", f"--workdir={tmp_path}")
  _one_error_line(r, f"workdir {tmp_path} is in use by a live run (pid {holder.pid} on ")


def test_pretrain_main_overrides_without_a_config_say_to_give_one(tmp_path):
  _one_error_line(_run("pretrain_main.py", "--config.init.hf=/nonexistent", f"--workdir={tmp_path}"),
                  "--config.init.hf overrides a field of a config file, but no --config was given: add "
                  "--config=experiments/configs/pretrain.py:colab")
  _one_error_line(_run("pretrain_main.py", "--config=experiments/configs/pretrain.py:tiny",
                       "--config.init.hf=/nonexistent", f"--workdir={tmp_path}"),
                  "--config.init.hf=/nonexistent: no such directory")


def test_eval_and_agent_mains_without_a_config_are_one_line():
  _one_error_line(_run("eval_main.py"), "--config is required, e.g. --config=experiments/configs/eval.py:procedural")
  _one_error_line(_run("agent_main.py"), "--config is required, e.g. --config=experiments/configs/agent.py:colab")
  _one_error_line(_run("agent_main.py", "--config=experiments/configs/agent.py:colab", "--config.harnes.seed=1"),
                  "no key 'harnes'")

