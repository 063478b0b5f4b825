"""The pretraining entry point as a user runs it: config errors, bad corpus, exact resume after SIGKILL."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "experiments", "pretrain_main.py")
TINY = [
    "--config=experiments/configs/pretrain.py:tiny",
    "--config.corpus.max_total_bytes=300000", "--config.data.seq_len=64", "--config.data.batch_size=4",
    "--config.train.log_every=1", "--config.train.eval_every=100", "--config.train.eval_batches=2",
    "--config.train.progress_bar=False",
]


def _cmd(workdir, *extra):
  return [sys.executable, MAIN, f"--workdir={workdir}", *TINY, *extra]


# A user's environment: no fake devices (the test session sets them for the sharding tests).
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _run(args, timeout=600):
  return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def _losses(workdir):
  """step → loss, the last logged value winning (a resumed run re-logs the steps after its checkpoint)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      out[row["step"]] = row["loss"]
  return out


def test_misspelled_override_names_the_key(tmp_path):
  r = _run(_cmd(tmp_path, "--config.trian.steps=3"), timeout=120)
  assert r.returncode != 0
  assert "trian" in r.stderr


def test_unknown_variant_and_stage_are_errors(tmp_path):
  r = _run([sys.executable, MAIN, f"--workdir={tmp_path}", "--config=experiments/configs/pretrain.py:huge"])
  assert r.returncode != 0 and "Unknown model variant 'huge'" in r.stderr
  r = _run([sys.executable, MAIN, f"--workdir={tmp_path}", "--config=experiments/configs/pretrain.py:tiny,stage=rl"])
  assert r.returncode != 0 and "Unknown stage 'rl'" in r.stderr


def test_empty_corpus_is_a_clear_error(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  r = _run(_cmd(tmp_path / "run", f"--config.corpus.paths=('{empty}',)", "--config.train.steps=2"))
  assert r.returncode != 0
  assert str(empty) in r.stderr and "Traceback" in r.stderr


def test_resume_after_sigkill_reproduces_the_uninterrupted_losses(tmp_path):
  steps = ["--config.train.steps=8", "--config.train.ckpt_every=3"]
  ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
  r = _run(_cmd(ref_dir, *steps))
  assert r.returncode == 0, r.stderr[-3000:]
  reference = _losses(ref_dir)
  assert sorted(reference) == list(range(1, 9))

  # Same run, SIGKILLed once the step-3 checkpoint is complete (its directory renamed into place) and step 4 is
  # logged: it resumes from step 3 and must replay steps 4.. exactly.
  proc = subprocess.Popen(_cmd(kill_dir, *steps), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, start_new_session=True, env=ENV)
  metrics = kill_dir / "metrics.jsonl"
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    done = (kill_dir / "checkpoints" / "3").is_dir() and metrics.exists() and any(
        json.loads(x)["step"] >= 4 for x in metrics.read_text().splitlines() if x.strip())
    if done:
      break
    time.sleep(0.05)
  assert proc.poll() is None, "the run finished before it could be killed: " + proc.stderr.read()[-2000:]
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert max(_losses(kill_dir)) < 8

  r = _run(_cmd(kill_dir, *steps))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Resumed from" in r.stdout and "at step 3" in r.stdout
  resumed = _losses(kill_dir)
  assert sorted(resumed) == list(range(1, 9))
  assert resumed == reference          # bit-exact: same data order, same RNG, same optimizer state
  assert os.path.isdir(kill_dir / "params")


@pytest.mark.slow
def test_stages_chain_pretrain_long_context(tmp_path):
  pre, long = tmp_path / "pre", tmp_path / "long"
  r = _run(_cmd(pre, "--config.train.steps=4", "--config.train.ckpt_every=4"))
  assert r.returncode == 0, r.stderr[-3000:]
  r = _run([sys.executable, MAIN, f"--workdir={long}",
            "--config=experiments/configs/pretrain.py:tiny,stage=long_context",
            "--config.corpus.max_total_bytes=300000", "--config.data.seq_len=256", "--config.data.batch_size=1",
            "--config.train.steps=2", "--config.train.eval_batches=1", "--config.train.progress_bar=False",
            f"--config.init.checkpoint={pre}"])
  assert r.returncode == 0, r.stderr[-3000:]
  assert os.path.isfile(long / "tokenizer" / "tokenizer.json")
  assert max(_losses(long)) == 2


def test_init_from_a_hugging_face_checkpoint(tmp_path):
  """`init.hf` starts training from a DeepseekV3 checkpoint: with a zero learning rate the exported params are it."""
  import jax
  import numpy as np

  from composer_jax import configs, model
  from composer_jax.interop import hf
  from composer_jax.train import stages
  from experiments.configs import model as model_configs
  cfg = configs.from_dict(model.ModelConfig, model_configs.get_config("tiny").to_dict())
  params = jax.device_get(model.init(jax.random.key(7), cfg))
  hf.save(str(tmp_path / "hf"), cfg, params)
  work = tmp_path / "run"
  r = _run(_cmd(work, f"--config.init.hf={tmp_path / 'hf'}", "--config.train.steps=1",
                "--config.optim.learning_rate=0.0", "--config.train.bias_update_rate=0.0"))
  assert r.returncode == 0, r.stderr[-3000:]
  exported = jax.device_get(stages.load_params(str(work), cfg))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(exported)):
    np.testing.assert_array_equal(a, b)
