"""Resuming never mixes settings: results are stored with the settings that define them, a rerun into the same
output with other settings is refused naming the difference, and summaries / plots cover every policy present."""

import dataclasses
import json

import pytest

from composer_jax.train import tokenizer as tokenizer_lib
from rollout import harness
from rollout.evaluation import policies, runner, suite
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import LocalFactory

CFG = harness.HarnessConfig(context_budget=2048, max_turn_tokens=768, observation_reserve=256, max_turns=8)


@pytest.fixture(scope="module")
def tok():
  texts = [f for t in procedural.generate(40, level=1) for f in t.environment.files.values()]
  return tokenizer_lib.train_tokenizer(texts + [harness.SYSTEM_PROMPT], tokenizer_lib.TokenizerConfig(500))


def _pol(tok, name):
  return {name: suite.Policy(lambda ts: policies.baseline(name, tok, ts), tok)}


def test_resume_refuses_other_settings_and_summaries_cover_every_policy(tmp_path, tok):
  tasks = procedural.generate(3, seed=1, split="heldout")
  envs = EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  out = str(tmp_path / "out")
  quiet = dict(log=lambda s: None)
  suite.evaluate({"s": tasks}, _pol(tok, "oracle"), envs, CFG, out, **quiet)
  bigger = dataclasses.replace(CFG, max_turn_tokens=1024)
  with pytest.raises(ValueError, match=r"other settings .*harness\.max_turn_tokens: 768 -> 1024.*new output dir"):
    suite.evaluate({"s": tasks}, _pol(tok, "oracle"), envs, bigger, out, **quiet)
  with pytest.raises(ValueError, match=r"samples: 1 -> 2"):
    suite.evaluate({"s": tasks}, _pol(tok, "oracle"), envs, CFG, out, runner.SampleConfig(samples=2), **quiet)
  # grade_workers, grade_early and tool_workers change speed, not results: resuming with other values is fine.
  suite.evaluate({"s": tasks}, _pol(tok, "oracle"), envs,
                 dataclasses.replace(CFG, grade_workers=1, grade_early=False, tool_workers=1), out, **quiet)
  # Another policy in a later run: the summary holds both, and the plot is redrawn with both.
  r = suite.evaluate({"s": tasks}, _pol(tok, "noop"), envs, CFG, out, **quiet)["s"]
  assert set(r["summaries"]) == {"oracle", "noop"} and r["notes"] == []
  assert set(json.loads((tmp_path / "out" / "s" / "summary.json").read_text())) == {"oracle", "noop"}
  # A policy evaluated in another harness is shown, with a note naming the difference.
  r = suite.evaluate({"s": tasks}, _pol(tok, "random"), envs, bigger, out, **quiet)["s"]
  assert set(r["summaries"]) == {"oracle", "noop", "random"}
  assert r["notes"] == ["noop: made with other settings (this run -> that one): harness.max_turn_tokens: 1024 -> 768",
                        "oracle: made with other settings (this run -> that one): harness.max_turn_tokens: 1024 -> 768"]
  assert "note: noop: made with other settings" in (tmp_path / "out" / "s" / "summary.txt").read_text()
  # A run on another task set (e.g. other contamination exclusions) is left out, not mixed in.
  r = suite.evaluate({"s": tasks[1:]}, _pol(tok, "noop"), envs, CFG, str(tmp_path / "out2"), **quiet)["s"]
  with pytest.raises(ValueError, match=r"the tasks differ \(other tasks, contents or labels\)"):
    suite.evaluate({"s": tasks}, _pol(tok, "noop"), envs, CFG, str(tmp_path / "out2"), **quiet)
  r = suite.evaluate({"s": tasks}, _pol(tok, "oracle"), envs, CFG, str(tmp_path / "out2"), **quiet)["s"]
  assert set(r["summaries"]) == {"oracle"} and r["notes"] == ["noop: left out, evaluated on another task set"]


def test_a_grown_set_runs_only_its_new_tasks(tmp_path, tok):
  """More tasks whose start is the stored set reuse its results; any other change of the set is refused."""
  tasks = procedural.generate(5, seed=2, split="heldout")
  envs = EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  out, lines = str(tmp_path / "out"), []

  def oracle(ts):
    return policies.baseline("oracle", tok, ts)
  first = runner.run_policy("oracle", oracle(tasks[:2]), tok, tasks[:2], envs, CFG, out,
                            runner.SampleConfig(chunk_tasks=2), log=lines.append)
  assert [r["task_id"] for r in first] == [t.id for t in tasks[:2]]
  grown = runner.run_policy("oracle", oracle(tasks), tok, tasks, envs, CFG, out,
                            runner.SampleConfig(chunk_tasks=2), log=lines.append)
  assert [r["task_id"] for r in grown] == [t.id for t in tasks]
  assert grown[:2] == first and all(r["samples"][0]["solved"] == 1.0 for r in grown)
  assert "[oracle] the set grew from 2 to 5 tasks: only the new ones are run" in lines
  with open(tmp_path / "out" / runner.RESULTS) as f:
    assert [json.loads(x)["task_id"] for x in f] == [t.id for t in tasks]   # each task once: 2 were not re-run
  assert runner.read_run_info(out)["set"] == runner.set_fingerprint(tasks)
  # A set that is not a grown one (fewer tasks, or other tasks first) is refused as before.
  for other in (tasks[:3], tasks[1:] + tasks[:1]):
    with pytest.raises(ValueError, match=r"the tasks differ"):
      runner.run_policy("oracle", oracle(other), tok, other, envs, CFG, out, log=lines.append)
  more = tasks + procedural.generate(1, seed=9, split="heldout")
  with pytest.raises(ValueError, match=r"chunk_tasks: 2 -> 8"):   # growing keeps every other setting
    runner.run_policy("oracle", oracle(more), tok, more, envs, CFG, out, log=lines.append)


def test_run_info_records_the_harness(tmp_path):
  tasks = procedural.generate(2, seed=0)
  info = runner.run_settings("p", tasks, CFG, runner.SampleConfig())
  assert info["harness"]["max_turn_tokens"] == 768
  assert not {"grade_workers", "grade_early", "tool_workers"} & set(info["harness"])
  changed = [dataclasses.replace(tasks[0], tests=dataclasses.replace(tasks[0].tests, pass_to_pass=()))] + tasks[1:]
  assert runner.set_fingerprint(changed) != runner.set_fingerprint(tasks)  # relabelled tasks are another set
