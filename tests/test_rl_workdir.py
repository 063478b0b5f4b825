"""A workdir is safe to stop and resume: a resume with another config is refused naming the fields, a second live
run into it stops at once (a dead run's lock is taken over), and Ctrl-C during SFT or RL checkpoints the finished
steps so a rerun continues from there (SFT to the same params as an uninterrupted run)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from composer_jax import configs
from composer_jax.rl import experiment, loop, setup, warmstart
from composer_jax.rl import workdir as workdir_lib
from composer_jax.rl.config import RunConfig
from composer_jax.train import interrupt
from experiments.configs import rl as rl_configs
from tests.workdir_testlib import live_lock_holder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(workdir, arg="test,mode=sync", **kw):
  return configs.replace(configs.from_dict(RunConfig, rl_configs.get_config(arg), workdir=str(workdir)), **kw)


def test_a_resume_with_another_config_is_refused_naming_the_fields(tmp_path):
  cfg = _cfg(tmp_path)
  with workdir_lib.claim(cfg):
    pass
  kl = configs.replace(cfg, **{"rl.loss.kl_coef": 0.5})
  with pytest.raises(workdir_lib.WorkdirError, match=r"rl\.loss\.kl_coef 0\.001 -> 0\.5\).*"
                                                     r"--resume_with_changes=rl\.loss\.kl_coef$"):
    with workdir_lib.claim(kl):
      pass
  with workdir_lib.claim(kl, allow=("rl.loss.kl_coef",)):   # named: allowed, and stored as the run's config now
    pass
  assert workdir_lib.stored_config(str(tmp_path)).rl.loss.kl_coef == 0.5
  # The held-out evaluation and the progress bar may change without asking; a whole section can be allowed.
  with workdir_lib.claim(configs.replace(kl, **{"eval.tasks": 3, "progress_bar": True})):
    pass
  grown = configs.replace(kl, **{"rl.steps": 9, "rl.ckpt_every": 3})
  with pytest.raises(workdir_lib.WorkdirError, match="rl.ckpt_every 2 -> 3, rl.steps 4 -> 9"):
    with workdir_lib.claim(grown):
      pass
  with workdir_lib.claim(grown, allow=("rl",)):
    pass


def test_a_run_refused_for_its_input_leaves_the_stored_config_as_it_was(tmp_path, monkeypatch):
  """The config is stored with the lock, before the run's input is checked: a refused fresh run removes it, a
  refused resume (here one growing the run) puts the earlier run's back, so a fixed rerun is compared with that."""
  from composer_jax.rl.config import RunInputError

  def refused(cfg, mesh=None):
    raise RunInputError("bad input")
  cfg = _cfg(tmp_path)
  real = setup.open_run
  monkeypatch.setattr(setup, "open_run", refused)
  with pytest.raises(RunInputError, match="bad input"), workdir_lib.claim(cfg):
    pass
  assert workdir_lib.stored_config(str(tmp_path)) is None
  monkeypatch.setattr(setup, "open_run", real)
  with workdir_lib.claim(cfg):
    pass
  monkeypatch.setattr(setup, "open_run", refused)
  with pytest.raises(RunInputError, match="bad input"), workdir_lib.claim(configs.replace(cfg, **{"rl.steps": 9}),
                                                                          allow=("rl.steps",)):
    pass
  assert workdir_lib.stored_config(str(tmp_path)) == cfg


def test_another_model_is_refused_before_any_work(tmp_path, monkeypatch):
  """The issue's `rl.py:test` then `rl.py:colab` into one workdir: refused at once, not a restore traceback."""
  with workdir_lib.claim(_cfg(tmp_path)):
    pass
  monkeypatch.setattr(experiment.warmstart, "warm_start", lambda *a: pytest.fail("the warm start ran"))
  with pytest.raises(workdir_lib.WorkdirError, match=r"another config \(model\..* and \d+ more\): pass another "
                                                     r"--workdir$"):
    experiment.run_experiment(_cfg(tmp_path, "colab"))


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "f").write_text("")
  with pytest.raises(workdir_lib.WorkdirError, match="is a file, not a directory"):
    with workdir_lib.claim(_cfg(tmp_path / "f")):
      pass


def test_a_live_runs_lock_stops_a_second_run_and_a_dead_ones_is_taken_over(tmp_path):
  with live_lock_holder(tmp_path) as holder:   # SIGKILLed at the end: no clean-up runs, the lock file stays behind
    with pytest.raises(workdir_lib.WorkdirError, match=rf"in use by a live run \(pid {holder.pid} on "):
      with workdir_lib.lock(str(tmp_path)):
        pass
  assert (tmp_path / "lock").exists()
  with workdir_lib.lock(str(tmp_path)):
    with workdir_lib.lock(str(tmp_path)):   # re-entrant within a process: the experiment around its RL loop
      assert f"pid {os.getpid()}" in (tmp_path / "lock").read_text()


def _interrupt_when(pred, timeout=300.0):
  """A thread that sends this process SIGINT (Ctrl-C) once `pred()` holds."""
  def watch():
    t0 = time.time()
    while not pred() and time.time() - t0 < timeout:
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)
  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  return thread


def _has_checkpoint(directory):
  return lambda: os.path.isdir(directory) and any(d.isdigit() for d in os.listdir(directory))


def _no_tmp_dirs(root):
  return [os.path.join(d, n) for d, dirs, _ in os.walk(root) for n in dirs if "tmp" in n]


def _warm_start(cfg, log_fn):
  with setup.open_run(cfg) as run:
    return warmstart.warm_start(cfg.sft_plan, run, log_fn)


def test_ctrl_c_in_sft_checkpoints_and_the_rerun_reaches_the_same_params(tmp_path, monkeypatch):
  kw = {"sft.steps": 40}
  whole = _warm_start(_cfg(tmp_path / "whole", **kw), log_fn=lambda s: None)
  cfg = _cfg(tmp_path / "stopped", **kw)
  watcher = _interrupt_when(_has_checkpoint(tmp_path / "stopped" / "sft" / "checkpoints"))
  with pytest.raises(interrupt.Interrupted, match=r"training stopped at step (\d+) of 40, checkpointed") as e:
    _warm_start(cfg, log_fn=lambda s: None)
  watcher.join()
  stopped_at = int(e.value.args[0].split("step ")[1].split(" ")[0])
  assert 4 <= stopped_at < 40 and not _no_tmp_dirs(tmp_path / "stopped")
  assert not (tmp_path / "stopped" / "sft" / "params").exists()
  logs = []
  monkeypatch.setattr(warmstart, "oracle_transcripts", lambda *a, **k: pytest.fail("demonstrations made again"))
  resumed = _warm_start(cfg, log_fn=logs.append)
  assert any("Resumed from" in line and f"at step {stopped_at}" in line for line in logs), logs
  # The demonstrations were read back, not made again; the data iterator continued where it stopped.
  flat = lambda p: np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)])   # noqa: E731
  np.testing.assert_allclose(flat(resumed), flat(whole), rtol=0, atol=1e-6)
  record = json.loads((tmp_path / "stopped" / "sft" / warmstart.TRAIN_SECONDS).read_text())
  assert record["steps"] == 40 - stopped_at   # the control's rate counts the steps this run trained itself


def test_ctrl_c_in_rl_checkpoints_the_finished_steps_and_the_rerun_trains_each_step_once(tmp_path):
  cfg = _cfg(tmp_path, **{"rl.steps": 6, "rl.ckpt_every": 100})
  metrics = tmp_path / "metrics.jsonl"
  watcher = _interrupt_when(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1)
  with pytest.raises(interrupt.Interrupted, match=r"RL stopped at step (\d) of 6, checkpointed") as e:
    loop.run_rl(cfg, log_fn=lambda s: None)
  watcher.join()
  stopped_at = int(e.value.args[0].split("step ")[1][0])
  assert 1 <= stopped_at < 6 and (tmp_path / "checkpoints" / str(stopped_at)).is_dir()
  assert not _no_tmp_dirs(tmp_path / "checkpoints")
  logs = []
  out = loop.run_rl(cfg, log_fn=logs.append)
  assert f"Resumed RL at step {stopped_at}" in logs and out["resumed_at"] == stopped_at
  applied = [json.loads(line)["step"] for line in open(tmp_path / "applied.jsonl")]
  assert applied == [1, 2, 3, 4, 5, 6]


def test_evaluating_an_rl_checkpoint_reads_its_model_from_the_run_config(tmp_path):
  """`eval.py:...,checkpoint=<RL workdir>` without `model=` takes the model the run stored (it failed on a leaf
  shape with the colab default); runs trained with different models cannot be evaluated as one shape."""
  from experiments.configs import eval as eval_configs
  with workdir_lib.claim(_cfg(tmp_path / "tiny")):
    pass
  c = eval_configs.get_config(f"procedural,policies=checkpoint,checkpoint={tmp_path / 'tiny'}")
  # rl.py:test's model: tiny with max_position_embeddings 1024 (no variant of configs/model.py has both)
  assert (c.checkpoint.model.hidden_size, c.checkpoint.model.max_position_embeddings) == (32, 1024)
  assert eval_configs.get_config("procedural").checkpoint.model.hidden_size == 128   # no checkpoint: colab
  with workdir_lib.claim(_cfg(tmp_path / "colab", "colab")):
    pass
  both = f"{tmp_path / 'tiny'}:{tmp_path / 'colab'}"
  with pytest.raises(ValueError, match="were trained with different model configs"):
    eval_configs.get_config(f"procedural,policies=checkpoint,checkpoint={both}")
  named = eval_configs.get_config(f"procedural,policies=checkpoint,checkpoint={both},model=rl_colab")
  assert named.checkpoint.model.hidden_size == 96


def test_evaluating_an_rl_checkpoint_runs_it_in_the_loop_it_was_trained_in(tmp_path):
  """`eval.py:file,...,checkpoint=runs/rl_colab,model=rl_colab` without `harness=` failed mid-run ("prompt bucket
  256 + output bucket 1024 exceed max_position_embeddings=1024"): the default loop's budgets are not colab's. The
  checkpoint's stored loop is now the default; `harness=default` or a preset still overrides it."""
  from experiments.configs import eval as eval_configs
  cfg = _cfg(tmp_path / "colab", "colab")
  with workdir_lib.claim(cfg):
    pass
  c = eval_configs.get_config(f"procedural,policies=checkpoint,checkpoint={tmp_path / 'colab'},model=rl_colab")
  h = cfg.harness
  assert (c.harness.context_budget, c.harness.max_turn_tokens, c.harness.max_turns, c.harness.max_segments) == (
      h.context_budget, h.max_turn_tokens, h.max_turns, h.max_segments)
  assert c.harness.context_budget <= c.checkpoint.model.max_position_embeddings and not c.auto_budget
  plain = eval_configs.get_config(f"procedural,policies=checkpoint,checkpoint={tmp_path / 'colab'},harness=default")
  assert plain.harness.context_budget == 4096


@pytest.mark.slow   # ~75 s on the loaded 2-core machine (a subprocess through its demonstrations into SFT)
def test_ctrl_c_of_rl_main_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
  """The issue's Ctrl-C: a 112-line traceback and a leftover `*.orbax-checkpoint-tmp`; now one line, exit 130."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "rl_main.py"),
                           "--config=experiments/configs/rl.py:test,mode=sync", "--config.sft.steps=2000",
                           f"--workdir={tmp_path}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  ckpts = tmp_path / "sft" / "checkpoints"
  deadline = time.time() + 300
  while not _has_checkpoint(ckpts)() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.1)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("interrupted: training stopped at step ") and last.endswith(
      "checkpointed in " + str(ckpts) + ": rerun the same command to resume"), err[-3000:]
  assert not _no_tmp_dirs(tmp_path)
