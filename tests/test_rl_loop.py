"""The RL loop end to end on a tiny model: synchronous in-process, and asynchronous with worker processes under
SIGKILL of a worker and of the trainer (restart; every queued group trained on exactly once, none lost)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from composer_jax import configs
from composer_jax.rl import loop
from composer_jax.rl import workdir as workdir_lib
from composer_jax.rl.config import RunConfig
from composer_jax.train import metrics as metrics_lib
from experiments.configs import rl as rl_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(workdir, arg, **kw):
  """rl.py:`arg` with dotted-path overrides (`**{"rl.steps": 2}`)."""
  return configs.replace(configs.from_dict(RunConfig, rl_configs.get_config(arg), workdir=str(workdir)), **kw)


def _applied(workdir):
  with open(os.path.join(workdir, "applied.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_sync_loop_trains_on_fresh_groups_only(tmp_path):
  cfg = _cfg(tmp_path, "test,mode=sync", **{"rl.steps": 2, "rl.ckpt_every": 1})
  out = loop.run_rl(cfg, log_fn=lambda s: None)
  rows = _applied(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  assert all(len(r["keys"]) == cfg.rl.groups_per_step for r in rows)
  m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in m] == [1, 2]
  assert all(r["staleness_mean"] == 0.0 and r["dropped_stale"] == 0.0 for r in m)
  # On-policy: the trainer's logprobs of the engine's tokens equal the engine's (router replay, same weights).
  assert m[0]["logprob_gap_replay"] < 1e-3 and m[0]["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-3)
  # Router replay wiring: the engine's recorded experts reach the batch, and equal the trainer's own choice.
  assert m[0]["routing_mismatch_rate"] < 0.01
  for k in ("reward", "pass_rate", "length", "kl", "entropy", "clip_fraction", "queue_depth_groups",
            "trainer_idle_fraction", "importance_ratio_max"):
    assert k in m[-1]
  assert int(out["last"]["step"]) == 2 and (tmp_path / "reward.png").exists()
  # The length penalty is on in every variant, so its term is plotted beside the others that fired.
  assert all(r["reward/length"] < 0 for r in m) and "reward/length" in metrics_lib.penalty_terms(m)
  assert (tmp_path / "reward_terms.png").exists()


def _wait(pred, timeout, what):
  t0 = time.time()
  while not pred():
    if time.time() - t0 > timeout:
      raise TimeoutError(f"timed out waiting for {what}")
    time.sleep(0.2)


@pytest.mark.slow
def test_async_loop_survives_sigkill_of_worker_and_trainer(tmp_path):
  cfg = _cfg(tmp_path, "test,mode=async", **{"rl.steps": 6, "rl.ckpt_every": 2})
  workdir_lib.save_config(cfg)
  env = dict(os.environ, PYTHONPATH=ROOT)
  log = open(tmp_path / "trainer.log", "a")
  cmd = [sys.executable, "-m", "composer_jax.rl.loop", str(tmp_path)]
  trainer = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  wstate, wpid = tmp_path / "workers" / "worker0.json", tmp_path / "workers" / "worker0.pid"
  try:
    # 1. SIGKILL the worker once it has queued a group; the trainer restarts it, it resumes its stream.
    _wait(lambda: wstate.exists() and json.load(open(wstate))["next"] >= 1, 600, "the first queued group")
    first_pid = int(wpid.read_text())
    os.kill(first_pid, signal.SIGKILL)
    # 2. SIGKILL the trainer after it trained past a checkpoint (its worker dies with it: PR_SET_PDEATHSIG).
    _wait(lambda: (tmp_path / "applied.jsonl").exists() and len(_applied(tmp_path)) >= 3, 600, "step 3")
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    before = {r["step"]: r["keys"] for r in _applied(tmp_path)}
    ckpt = max(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert 2 <= ckpt < 6 and max(before) >= 3
    # 3. Restart; it resumes at the checkpoint and finishes.
    trainer = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    assert trainer.wait(timeout=900) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
  finally:
    if trainer.poll() is None:
      trainer.kill()
  after = {r["step"]: r["keys"] for r in _applied(tmp_path)}
  assert sorted(after) == [1, 2, 3, 4, 5, 6]
  keys = [k for s in sorted(after) for k in after[s]]
  assert len(keys) == len(set(keys)) == 6 * cfg.rl.groups_per_step            # nothing trained on twice
  for s, ks in before.items():
    assert after[s] == ks, f"step {s}: groups changed across the restart"   # checkpointed steps kept; redone steps
    # re-delivered exactly the groups the killed trainer had consumed (none lost)
  assert int(wpid.read_text()) != first_pid
  assert "worker0 exited" in (tmp_path / "trainer.log").read_text()       # the supervisor restarted it
  m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert all(r["staleness_mean"] <= cfg.rollout.max_staleness for r in m)
