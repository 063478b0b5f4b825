"""RL with rollouts on a real SGLang fleet (`engine='sglang'`): the trainer starts the servers, pushes every
published policy to them as a Hugging Face checkpoint, and the worker processes attach to them.

One run of the tiny test model, asynchronous with one worker process (~2 min on a loaded 2-core machine, most of it
the server start). SGLang on CPU serves float32 like the trainer, so the trainer's logprobs of the served tokens and
its own top-k must match what the servers reported (router replay wiring through a real engine).
"""
import json
import os

import pytest
import sglang_testlib

from composer_jax import configs
from composer_jax.rl import fleet as fleet_lib
from composer_jax.rl import loop
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs


def _group_alive(pgid):
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  return True


def test_async_rl_on_an_sglang_fleet(tmp_path):
  sglang_testlib.require_sglang()
  c = rl_configs.get_config("test,mode=async,engine=sglang,steps=3")
  c.rl.ckpt_every = 3
  cfg = configs.from_dict(RunConfig, c, workdir=str(tmp_path))
  out = loop.run_rl(cfg, log_fn=print)
  m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in m] == [1, 2, 3]
  applied = [json.loads(line) for line in open(tmp_path / "applied.jsonl")]
  keys = [k for r in applied for k in r["keys"]]
  assert len(keys) == len(set(keys)) == 3 * cfg.rl.groups_per_step          # each group trained on once
  fresh = [r for r in m if r["staleness_mean"] == 0]
  assert fresh and all(r["staleness_mean"] <= cfg.rollout.max_staleness for r in m)
  for r in fresh:
    # Groups of the trainer's own version: its logprobs of the served tokens equal the server's (f32 both sides;
    # measured < 1e-6) and its top-k equals the experts the server reported at every recorded position.
    assert r["logprob_gap_replay"] < 1e-4, r
    assert r["routing_mismatch_rate"] < 0.01, r
  # Every step was published to the servers: the fleet served version 3 last, from a checkpoint the trainer wrote.
  state = json.load(open(tmp_path / fleet_lib.FLEET_FILE))
  assert state["version"] == 3 and state["model_path"].endswith(os.path.join("hf", "v3"))
  assert sorted(os.listdir(tmp_path / "hf")) == ["v2", "v3"]             # older exports pruned
  assert max(r["publish_s"] for r in m) > 0
  # Versions seen by the trainer come from the servers (not all from the start: publishing reached the samples).
  assert any(r["staleness_0"] + r.get("staleness_1", 0) > 0 for r in m[1:])
  assert not any(_group_alive(p) for p in state["pgids"])                # train_rl stopped its servers
  assert int(out["last"]["step"]) == 3


def test_sglang_engine_without_sglang_names_the_install(tmp_path, monkeypatch):
  c = rl_configs.get_config("test,engine=sglang,steps=1")
  cfg = configs.from_dict(RunConfig, c, workdir=str(tmp_path))
  monkeypatch.setattr(fleet_lib.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(RuntimeError, match="install_sglang_cpu.sh"):
    fleet_lib.FleetPublisher(cfg, params=None, version=0)
