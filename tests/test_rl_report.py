"""rl.report: tables and plots from results.json, every figure traced to its input."""
import json
import os
import subprocess
import sys

import pytest

from composer_jax.rl import report
from rollout.evaluation.metrics import wilson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fig(solved, n, tokens):
  lo, hi = wilson(solved, n)
  return {"success": solved / n, "ci_low": lo, "ci_high": hi, "n": n, "tokens_per_solved": tokens}


def _result(rl_l2_solved=30):
  """A results.json as run_experiment writes it: per policy and temperature, overall and per level (n = 40)."""
  def policy(l1, l2, tokens):
    levels = {"1": _fig(l1, 40, tokens), "2": _fig(l2, 40, None if l2 == 0 else 2 * tokens)}
    return {"success": (l1 + l2) / 80, "ci_low": 0.0, "ci_high": 1.0, "n": 80, "tokens_per_solved": tokens,
            "levels": levels}
  return {"sft": {"T0": policy(20, 4, 100), "T1": policy(16, 2, 110)},
          "rl": {"T0": policy(30, 20, 90), "T1": policy(32, rl_l2_solved, 80)},
          "sft_control": {"T0": policy(22, 5, 100), "T1": policy(18, 0, 105)},
          "phase_seconds": {"sft_start": 120.0, "rl": 600.0, "total": 900.0}, "rl_steps": 100}


def test_cells_tables_and_gains_by_hand():
  r = _result()
  lo, hi = wilson(32, 40)
  assert report.cell(r["rl"]["T1"]["levels"]["1"]) == f"80.0% [{100 * lo:.1f}, {100 * hi:.1f}]"
  assert report.cell(None) == "—"
  assert report.levels_of(r) == ["1", "2"]
  table = report.policy_table(r).splitlines()
  assert table[0] == "| policy (n = 40 per level) | L1 greedy | L1 T=1 | L2 greedy | L2 T=1 |"
  assert table[2].startswith("| SFT start | 50.0% [") and table[3].startswith("| RL | 75.0% [")
  assert len(table) == 5   # start, RL, control: no row for the unevaluated summaries policy
  g = report.gains(r)
  assert g["1"] == pytest.approx({"over_start": 40.0, "over_control": 35.0})
  assert g["2"] == pytest.approx({"over_start": 70.0, "over_control": 75.0})
  sweep = report.sweep_table([("a", r), ("b", _result(rl_l2_solved=0))]).splitlines()
  assert sweep[0] == "| run (RL) | L1 T=1 | L1 tokens/solved | L2 T=1 | L2 tokens/solved |"
  l2 = report.cell(_fig(30, 40, None))   # RL at T=1 on level 2: 30/40, tokens per solved 2 × 80
  assert sweep[2].endswith(f"| 80 | {l2} | 160 |")
  assert sweep[3].endswith("| 0.0% [0.0, 8.8] | — |")   # nothing solved: no tokens per solved task


def test_render_writes_tables_plots_and_the_readme_block(tmp_path):
  for name, r in (("s0", _result()), ("s1", _result(rl_l2_solved=10))):
    os.makedirs(tmp_path / name)
    (tmp_path / name / "results.json").write_text(json.dumps(r))
  readme = tmp_path / "README.md"
  readme.write_text("intro\n<!-- results:recipe -->\nold table\n<!-- /results:recipe -->\nafter\n")
  out = tmp_path / "results"
  cmd = [sys.executable, os.path.join(ROOT, "experiments/report_main.py"), "--name=recipe",
         f"--runs=seed0={tmp_path / 's0'},seed1={tmp_path / 's1' / 'results.json'}", "--length_runs=seed0,seed1",
         f"--out={out}", f"--readme={readme}"]
  subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
  md = (out / "recipe.md").read_text()
  assert report.policy_table(_result()) in md and "## All runs (RL policy, T=1)" in md
  assert "Phases: sft_start 2.0 min, rl 10.0 min, total 15.0 min." in md
  resumed = {**_result(), "rl_seconds": 1722.0, "rl_steps": 300,
             "phase_seconds": {"sft_start": 0.5, "rl": 12.0, "total": 60.0}}
  assert report._timing(resumed) == ("sft_start 0.0 min, rl 0.2 min, total 1.0 min (300 RL steps took 28.7 min in "
                                     "all, the runs it resumed included; the control got that)")
  assert report._timing({**resumed, "rl_seconds": 12.0}) == "sft_start 0.0 min, rl 0.2 min, total 1.0 min"
  copied = {**resumed, "control_seconds": 1490.0, "control_steps": 2090}   # a control sized for another run's RL
  assert report._timing(copied) == ("sft_start 0.0 min, rl 0.2 min, total 1.0 min (300 RL steps took 28.7 min in "
                                    "all, the runs it resumed included); the control's 2090 SFT steps were sized "
                                    "for 24.8 min of RL")
  assert report._timing({**copied, "control_seconds": 1700.0}) == report._timing(resumed)
  grown = {**resumed, "rl_seconds": 12.0, "earlier_phase_seconds": [{"sft_start": 1920.0, "rl": 1488.0}, {}]}
  assert report._timing(grown) == ("sft_start 0.0 min, rl 0.2 min, total 1.0 min; earlier invocations of this "
                                   "workdir, oldest first: [sft_start 32.0 min, rl 24.8 min]; [not recorded]")
  assert report._timing({"earlier_phase_seconds": [{"total": 60.0}]}) == \
      "earlier invocations of this workdir, oldest first: [total 1.0 min]"
  assert report._timing({}) == "not recorded"
  for png in ("recipe_levels.png", "recipe_levels_seed1.png", "recipe_tokens.png"):
    assert (out / png).stat().st_size > 1000 and f"]({png})" in md
  doc = readme.read_text()
  assert doc.startswith("intro\n<!-- results:recipe -->\n| policy")
  assert doc.endswith("<!-- /results:recipe -->\nafter\n")
  assert "old table" not in doc
  subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
  assert readme.read_text() == doc   # regenerating is idempotent


def test_bad_input_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="no '<!-- results:recipe -->'"):
    (tmp_path / "R.md").write_text("no markers")
    report.replace_block(str(tmp_path / "R.md"), "recipe", "x")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments/report_main.py"), "--runs=seed0"],
                     capture_output=True, text=True, cwd=ROOT)
  assert r.returncode != 0 and "is not label=path" in r.stderr
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments/report_main.py"),
                      f"--runs=a={tmp_path / 'missing'}"], capture_output=True, text=True, cwd=ROOT)
  assert r.returncode != 0 and "does not exist" in r.stderr


def test_render_states_rl_gains_per_level(tmp_path):
  (tmp_path / "results.json").write_text(json.dumps(_result()))
  report.render("r", [("s0", str(tmp_path))], str(tmp_path / "out"))
  md = (tmp_path / "out" / "r.md").read_text()
  # T=1, by hand from _result(): L1 32/40 vs 16/40 (start) and 18/40 (control); L2 30/40 vs 2/40 and 0/40.
  assert ("RL at T=1, in points: level 1 +40.0 over the start, +35.0 over the control; "
          "level 2 +70.0 over the start, +75.0 over the control.") in md


def test_summary_table_by_hand_on_the_summary_rows_levels(tmp_path):
  """The summary rows are evaluated on level 2 only here: one row, RL's own level-2 figures beside them."""
  r = _result()
  level2 = lambda solved_t0, solved_t1, tokens: {   # noqa: E731
      t: {"success": s / 40, "n": 40, "levels": {"2": _fig(s, 40, tokens)}}
      for t, s in (("T0", solved_t0), ("T1", solved_t1))}
  r["rl_start_summaries"] = level2(16, 12, 95)
  r["rl_drop_oldest"] = level2(0, 0, None)
  assert report.summary_table([("no summary rows", _result())]) == ""
  table = report.summary_table([("plain", _result()), ("s0", r)]).splitlines()
  assert len(table) == 3 and table[0].startswith("| run | level | n | own summaries |")
  # RL level 2: greedy 20/40, T=1 30/40 with tokens 2 × 80; the start's summaries 16/40, 12/40; none 0/40.
  assert table[2] == ("| s0 | level 2 | 40 | 50.0/75.0 | 40.0/30.0 | 0.0/0.0 | +10.0/+45.0 | +50.0/+75.0 "
                      "| 160 / 95 |")
  (tmp_path / "results.json").write_text(json.dumps(r))
  report.render("r", [("s0", str(tmp_path))], str(tmp_path / "out"))   # the plot draws no bar for level 1
  md = (tmp_path / "out" / "r.md").read_text()
  assert "## Do trained summaries help?" in md and table[2] in md


def test_terms_table_by_hand(tmp_path):
  assert report.terms_table(_result()) == ""   # not recorded: no table
  r = {**_result(), "reward_terms": {"reward": [0.3, 0.5], "reward/length": [-0.035, -0.0349]}}
  assert report.terms_table(r).splitlines() == [
      "| term (mean per episode) | steps, part 1/2 | steps, part 2/2 |", "|---|---|---|",
      "| reward | +0.3000 | +0.5000 |", "| reward/length | -0.0350 | -0.0349 |"]
  (tmp_path / "results.json").write_text(json.dumps(r))
  report.render("r", [("s0", str(tmp_path))], str(tmp_path / "out"))
  assert report.terms_table(r) in (tmp_path / "out" / "r.md").read_text()


def test_start_table_and_a_calibration_render_by_hand(tmp_path):
  """eval.start_only runs: only the SFT start's row; the report tables the starts (greedy / T=1 per level, SFT
  cost) and claims no RL gain for them."""
  full = _result()
  start = {"sft": full["sft"], "start_only": True, "sft_steps": 900, "sft_tasks": 1024,
           "phase_seconds": {"sft_start": 300.0, "eval_sft": 60.0, "total": 360.0}}
  table = report.start_table([("cal", start), ("run", full), ("curriculum", {**start, "sft_curriculum_steps": 700})])
  table = table.splitlines()
  assert table[0] == "| run | SFT tasks | SFT steps | SFT min | L1 greedy / T=1 | L2 greedy / T=1 |"
  # the start: L1 20/40 greedy, 16/40 at T=1; L2 4/40 and 2/40; SFT 300 s
  assert table[2] == "| cal | 1024 | 900 | 5.0 | 50.0/40.0 | 10.0/5.0 |"
  assert table[3] == "| run | — | — | — | 50.0/40.0 | 10.0/5.0 |"   # a trained run's SFT time is on its Phases line
  assert table[4] == "| curriculum | 1024 | 700 + 900 | 5.0 | 50.0/40.0 | 10.0/5.0 |"
  for name, r in (("cal", start), ("full", full)):
    (tmp_path / f"{name}.json").write_text(json.dumps(r))
  report.render("c", [("cal", str(tmp_path / "cal.json")), ("full", str(tmp_path / "full.json"))],
                str(tmp_path / "out"))
  md = (tmp_path / "out" / "c.md").read_text()
  cal = md.split("## cal", 1)[1].split("## full", 1)[0]
  assert "The start only (`eval.start_only`)." in cal and "RL at T=1" not in cal
  assert "RL at T=1, in points: level 1 +40.0" in md.split("## full", 1)[1]
  assert "## SFT starts (greedy / T=1, % solved)" in md
  assert report.start_table([("cal", start), ("full", full)]) in md
  assert "## All runs (RL policy, T=1)" not in md   # one trained run: nothing to compare
