"""The RL-arm drivers of benchmarks/rl_from_start.py, benchmarks/tree_learning.py and benchmarks/mtp_rl.py: an arm's
config loads the shared start, a wall-clock budget stops the RL loop as Ctrl-C does, and the reports' figures."""
import json
import os
import threading
import time

import pytest

from benchmarks import rl_from_start, tree_learning
from composer_jax.train import interrupt


def _log(workdir, step, step_s, **more):
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": step, "step_s": step_s, **more}) + "\n")


def test_arm_loads_the_start_without_sft_of_its_own(tmp_path):
  cfg = rl_from_start.from_start("default", str(tmp_path / "start"), str(tmp_path / "arm"), 1,
                                 **{"rl.mtp_weight": 0.3})
  assert cfg.sft.steps == 0 and cfg.sft.init_checkpoint == str(tmp_path / "start" / "sft")
  assert cfg.sft.curriculum_levels == () and not cfg.eval.control
  assert cfg.model.num_nextn_predict_layers == 1 and cfg.rl.mtp_weight == 0.3 and cfg.seed == 1
  start = rl_from_start.recipe_config("default", str(tmp_path / "start"))
  assert start.sft.steps == 3600 and start.sft.curriculum_steps == 900 and start.rl.steps == cfg.rl.steps == 300


def test_tree_arm_groups_as_trees_and_may_run_longer(tmp_path):
  flat = tree_learning.arm_config("default", "s", str(tmp_path), "flat", 0, (2, 3), (0, 2), (2, 4))
  tree = tree_learning.arm_config("default", "s", str(tmp_path), "tree", 0, (2, 3), (0, 2), (2, 4))
  assert flat.rollout.tree is None and tree.rollout.tree is not None and tree.rl.share_prefix
  assert flat.tasks.levels == tree.tasks.levels == (2, 3) and flat.eval.tasks == 1000
  assert flat.rl.mtp_weight == 0 and flat.rollout.draft_tokens == 0
  assert tree.rl.steps == tree_learning.TREE_MAX_STEPS * flat.rl.steps
  with pytest.raises(ValueError, match="unknown arm"):
    tree_learning.arm_config("default", "s", str(tmp_path), "forest", 0, (2,), (0,), (8,))


def _loop(workdir, steps, step_s, stopper):
  """A stand-in for the RL loop: logs a step every `step_s` seconds, stops as `rl.loop.train_rl` does."""
  with interrupt.StopAtStep("RL") as stop:
    for step in range(1, steps + 1):
      time.sleep(step_s)
      _log(workdir, step, step_s)
      if stop.requested and step < steps:
        raise interrupt.Interrupted(f"stopped at {step}")
    time.sleep(3 * stopper.poll_s)   # the watcher must stay quiet after the last step
  return steps


def test_stop_after_stops_the_loop_once_the_budget_is_spent(tmp_path):
  assert threading.current_thread() is threading.main_thread()
  stopper = rl_from_start.StopAfter(str(tmp_path), budget_s=0.5, last_step=100, poll_s=0.02)
  with pytest.raises(interrupt.Interrupted), stopper:
    _loop(str(tmp_path), 100, 0.1, stopper)
  logged = rl_from_start.step_seconds(str(tmp_path))
  assert stopper.fired and 5 <= max(logged) < 50   # 0.5 s spent at step 5; then the poll and the step in flight


def test_stop_after_leaves_a_run_that_ends_within_its_budget(tmp_path):
  stopper = rl_from_start.StopAfter(str(tmp_path), budget_s=0.4, last_step=3, poll_s=0.02)
  with stopper:
    assert _loop(str(tmp_path), 3, 0.15, stopper) == 3   # spent at the last step: nothing to stop
  assert not stopper.fired


def test_step_seconds_counts_a_rerun_step_once(tmp_path):
  for step, s in ((1, 2.0), (2, 3.0), (2, 5.0)):
    _log(str(tmp_path), step, s)
  assert rl_from_start.step_seconds(str(tmp_path)) == {1: 2.0, 2: 5.0}


def test_reports_read_a_resumed_run_once_per_step(tmp_path):
  """A resumed run logs the steps after its checkpoint again: the curve keeps each step once, its last line."""
  for step, acc in ((1, 0.5), (2, 0.6), (3, 0.7), (2, 0.8), (3, 0.9), (4, 1.0)):
    _log(str(tmp_path), step, 1.0, mtp_acceptance=acc)
  rows = rl_from_start.logged_steps(str(tmp_path))
  assert [(r["step"], r["mtp_acceptance"]) for r in rows] == [(1, 0.5), (2, 0.8), (3, 0.9), (4, 1.0)]


def test_learning_report_figures(tmp_path):
  arm = tree_learning.arm_dir(str(tmp_path), "flat", 0)
  os.makedirs(arm)
  _log(arm, 1, 10.0, trajectories=8, generated_tokens=800, rollout_s=6.0, **{"pass/level_2": 0.25})
  _log(arm, 2, 20.0, trajectories=8, generated_tokens=400, rollout_s=2.0, **{"pass/level_2": 0.5})
  _log(arm, 2, 30.0, trajectories=8, generated_tokens=1200, rollout_s=4.0, **{"pass/level_2": 0.75})   # rerun
  rows = rl_from_start.logged_steps(arm)
  assert [r["step"] for r in rows] == [1, 2]
  assert tree_learning.per_leaf(rows) == {"generated_tokens_per_leaf": 2000 / 16, "step_s_mean": 20.0}
  c = tree_learning.curve(rows)
  assert c["seconds"] == [10.0, 40.0] and c["pass/level_2"] == [0.25, 0.75]
  text = tree_learning.table({"load_avg": (1.0, 1.0, 1.0), "arms": {"flat_seed0": {
      "finished": False, "result": None, "steps": 2, **tree_learning.per_leaf(rows), "curve": c}}})
  assert "| flat_seed0 | False | 2 | 40 | 125.0 | 20.0 | not measured yet |" in text


def test_learning_report_carries_finished_arms_run_elsewhere(tmp_path):
  """Seed 1's arms reported on a machine without seed 0's workdirs: seed 0's finished arms stay as the previous
  JSON holds them, a partial arm there is dropped (its figures are stale), and what this workdir has is reread."""
  results, runs = str(tmp_path / "results"), str(tmp_path / "runs")
  os.makedirs(results)
  old = {"finished": True, "result": {"rl": None}, "steps": 300, "generated_tokens_per_leaf": 223.0,
         "step_s_mean": 6.5, "curve": {"seconds": [6.5], "step": [1]}}
  with open(os.path.join(results, f"{tree_learning.NAME}.json"), "w") as f:
    json.dump({"load_avg": [1.0], "arms": {"flat_seed0": old, "tree_seed1": {**old, "finished": False, "steps": 12},
                                           "flat_seed1": {**old, "steps": 7}}}, f)
  arm = tree_learning.arm_dir(runs, "flat", 1)
  os.makedirs(arm)
  _log(arm, 1, 4.0, trajectories=8, generated_tokens=800, **{"pass/level_2": 0.5})
  got = tree_learning.report(runs, results=results)
  assert got == {"flat_seed0": {"finished": True, "steps": 300, "generated_tokens_per_leaf": 223.0, "step_s_mean": 6.5},
                 "flat_seed1": {"finished": False, "steps": 1, "generated_tokens_per_leaf": 100.0, "step_s_mean": 4.0}}
  with open(os.path.join(results, f"{tree_learning.NAME}.json")) as f:
    assert json.load(f)["arms"]["flat_seed0"] == old
  assert os.path.exists(os.path.join(results, f"{tree_learning.NAME}.png"))


def test_learning_table_cells_of_a_finished_arm():
  cell = {"success": 0.5, "ci_low": 0.456, "ci_high": 0.544}
  rl = {t: {**cell, "levels": {"2": cell, "3": {**cell, "success": 0.25}}} for t in ("T0", "T1")}
  assert tree_learning._cell(rl, "T1", "3") == "0.250 [0.456, 0.544]"
  assert tree_learning._cell(rl, "T0", "1") == "—" and tree_learning._cell(None, "T0", "2") == "not measured yet"
  curve = {"seconds": [12.0], "step": [1]}
  text = tree_learning.table({"load_avg": (1.0,), "arms": {"tree_seed1": {
      "finished": True, "result": {"rl": rl, "load_avg_start": [3.04], "load_avg_end": [7.96]}, "steps": 1,
      "generated_tokens_per_leaf": 100.0, "step_s_mean": 12.0, "curve": curve}}})
  assert "| tree_seed1 | True | 1 | 12 | 100.0 | 12.0 | 0.500 [0.456, 0.544] | 0.250" in text
  assert "| 3.0 → 8.0 |" in text
