"""The equal-wall-clock SFT control: how many steps it gets (RL's whole wall-clock, resumed parts included, at the
warm start's rate of SFT steps), that its size is chosen once, and that a run grown to more RL steps gets a control
(and evaluations) of its own."""
import json
import os
import types

import pytest

from composer_jax import configs
from composer_jax.parallel.rules import ShardingRules
from composer_jax.rl import setup, warmstart
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs
from tests.run_testlib import fake_run


def test_a_resumed_runs_control_gets_all_of_rls_wall_clock(tmp_path, monkeypatch):
  """RL resumed after step 3 (a crash past its checkpoint re-ran steps 2-3): the control's seconds are this run's
  RL wall-clock plus the logged step time of steps 1-3, each step once (the run that checkpointed it logged it
  last); a log that lacks steps is an error, not a short control."""
  from composer_jax.rl import experiment
  rows = [(1, 10.0), (2, 11.0), (3, 12.0), (2, 20.0), (3, 30.0), (4, 40.0)]   # the second process crashed at 4
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_s": t, "reward": 0.0}) + "\n"
                                                  for s, t in rows))
  assert experiment.earlier_rl_seconds(str(tmp_path), 0) == 0.0
  assert experiment.earlier_rl_seconds(str(tmp_path), 3) == 10.0 + 20.0 + 30.0
  with pytest.raises(ValueError, match="step time of 4 of the 5 RL steps"):
    experiment.earlier_rl_seconds(str(tmp_path), 5)
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("colab"), workdir=str(tmp_path))
  seconds = []

  monkeypatch.setattr(experiment, "evaluate_at_temperatures", lambda *a, **k: {"T1": {"success": 0.5}})
  monkeypatch.setattr(experiment.warmstart, "warm_start", lambda c, run, log: "start")
  monkeypatch.setattr(experiment.loop, "train_rl",
                      lambda c, start, run, log: {"params": "rl", "last": {}, "resumed_at": 3})
  monkeypatch.setattr(experiment, "sft_control", lambda c, run, start, s, log: seconds.append(s) or "control")
  fake_run(monkeypatch, heldout=[types.SimpleNamespace(id="t", metadata={})])
  (tmp_path / "sft").mkdir()
  result = experiment.run_experiment(cfg, log_fn=lambda s: None)
  assert seconds == [pytest.approx(result["phase_seconds"]["rl"] + 60.0)] and result["rl_seconds"] == seconds[0]


def test_the_controls_size_is_chosen_once(tmp_path, monkeypatch):
  """The control's steps come from RL's seconds and the warm start's rate once; a rerun with another RL wall-clock
  (a resumed evaluation, a grown held-out set) trains and evaluates that same control, and results.json says so."""
  from composer_jax.rl import experiment
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("colab"), workdir=str(tmp_path))
  (tmp_path / "sft").mkdir()
  (tmp_path / "sft" / "train_seconds.json").write_text(json.dumps({"steps": 400, "seconds": 200.0}))
  steps = []
  monkeypatch.setattr(experiment.warmstart, "sft", lambda *a, **k: steps.append(k["steps"]) or ("control", None))
  assert experiment.control_size(str(tmp_path), cfg.rl.steps) is None
  assert experiment.sft_control(cfg, None, "start", 100.0, lambda s: None) == "control"
  assert experiment.sft_control(cfg, None, "start", 160.0, lambda s: None) == "control"
  assert steps == [200, 200]
  assert experiment.control_size(str(tmp_path), cfg.rl.steps) == {"steps": 200, "seconds": 100.0,
                                                                     "seconds_per_step": 0.5}


def test_the_control_is_sized_by_the_starts_training_steps_not_its_demonstrations(tmp_path, monkeypatch):
  """The rate that sizes the control is the warm start's SFT steps' wall-clock over their steps, every stage
  counted: making the demonstrations (sandboxed oracle episodes, here 1 s) is not in it, since the control reads
  them. Without a record the control cannot be sized, and the error says what is missing."""
  import time as time_lib

  from composer_jax.rl import experiment
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("colab"), workdir=str(tmp_path))
  with pytest.raises(ValueError, match="train_seconds.json is missing"):
    warmstart.seconds_per_step(str(tmp_path))
  monkeypatch.setattr(warmstart, "sft_transcripts", lambda *a, **k: time_lib.sleep(1.0) or (["demo"], ["dev"]))
  monkeypatch.setattr(warmstart, "run_sft", lambda *a, **k: time_lib.sleep(0.05) or ("params", {}))
  run = setup.Run(None, [], [], [], None, str(tmp_path), False, None, ShardingRules())
  assert warmstart.sft(cfg.sft_plan, run, None, str(tmp_path / "sft"), steps=10, learning_rate=1e-3, seed=0,
                       log_fn=lambda s: None) == ("params", {})
  record = json.load(open(tmp_path / "sft" / "train_seconds.json"))
  assert record["steps"] == 10 and 0.05 <= record["seconds"] < 1.0
  (tmp_path / "sft" / "train_seconds.json").write_text(json.dumps({"steps": 1800, "seconds": 700.0}))
  (tmp_path / "sft_curriculum").mkdir()
  (tmp_path / "sft_curriculum" / "train_seconds.json").write_text(json.dumps({"steps": 900, "seconds": 380.0}))
  assert warmstart.seconds_per_step(str(tmp_path)) == pytest.approx(1080.0 / 2700)
  monkeypatch.setattr(experiment.warmstart, "sft", lambda *a, **k: ("control", None))
  experiment.sft_control(cfg, None, "start", 1594.0, lambda s: None)
  assert experiment.control_size(str(tmp_path), cfg.rl.steps)["steps"] == int(1594.0 / (1080.0 / 2700))


def test_a_run_grown_to_more_rl_steps_evaluates_its_new_policy_against_a_control_of_its_own(tmp_path, monkeypatch):
  """Rerun with more RL steps (3, then 5): the grown policy is evaluated under its own name, not read back from the
  3-step policy's results, and its control is sized by all 5 steps' wall-clock and trained from the start in a dir
  of its own; the 3-step control's record stays, and results.json keeps the first invocation's phase times."""
  from composer_jax.rl import experiment
  (tmp_path / "sft").mkdir()
  (tmp_path / "sft" / "train_seconds.json").write_text(json.dumps({"steps": 100, "seconds": 50.0}))
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_s": 10.0, "reward": 0.0}) + "\n"
                                                  for s in range(1, 6)))
  evaluated, controls = [], []

  monkeypatch.setattr(experiment, "evaluate_at_temperatures",
                      lambda c, params, run, tasks, name, **k: evaluated.append((name, params)) or
                      {"T1": {"success": 0.5}})
  monkeypatch.setattr(experiment.warmstart, "warm_start", lambda c, run, log: "start")
  monkeypatch.setattr(experiment.loop, "train_rl", lambda c, start, run, log: {"params": f"rl{c.rl.steps}", "last": {},
                                                                   "resumed_at": 3 if c.rl.steps == 5 else 0})
  monkeypatch.setattr(experiment.warmstart, "sft", lambda c, run, init, workdir, **k: controls.append(
      (os.path.relpath(workdir, tmp_path), init, k["steps"])) or (f"control{k['steps']}", None))
  fake_run(monkeypatch, heldout=[types.SimpleNamespace(id="t", metadata={})])
  d = rl_configs.get_config("colab")
  d.rl.steps = 3
  first = experiment.run_experiment(configs.from_dict(RunConfig, d, workdir=str(tmp_path)), log_fn=lambda s: None)
  d.rl.steps = 5
  grown = experiment.run_experiment(configs.from_dict(RunConfig, d, workdir=str(tmp_path)), log_fn=lambda s: None,
                                    allow_changes=("rl.steps",))   # growing a run is a change the user names
  # the first run's RL took ~0 s here (a 1-step control); the grown one's is steps 1-3's logged 30 s and its own
  assert controls == [("sft_control@3", "start", 1), ("sft_control@5", "start", 60)]
  assert evaluated == [("sft", "start"), ("rl@3", "rl3"), ("sft_control@3", "control1"),
                       ("sft", "start"), ("rl@5", "rl5"), ("sft_control@5", "control60")]
  assert experiment.control_size(str(tmp_path), 3)["steps"] == 1
  assert (grown["rl_steps"], grown["control_steps"], first["control_steps"]) == (5, 60, 1)
  assert grown["earlier_phase_seconds"] == [first["phase_seconds"]]
