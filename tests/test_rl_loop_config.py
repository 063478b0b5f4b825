"""RL run configuration errors, the Wilson interval, weight publishing and the rl_main config conversion."""
import json
import math
import os
import types

import numpy as np
import pytest

from composer_jax import configs
from composer_jax.model.config import ModelConfig
from composer_jax.parallel.rules import ShardingRules
from composer_jax.rl import evaluate, setup, warmstart, weight_files
from composer_jax.rl.config import RunConfig
from experiments.configs import common
from experiments.configs import rl as rl_configs
from rollout.tasks import procedural
from tests.run_testlib import fake_run


def _cfg(**overrides):
  """A RunConfig with dotted-path overrides (`**{"rollout.mode": "sync"}`)."""
  return configs.replace(RunConfig(model=ModelConfig(vocab_size=512), workdir="/tmp/unused"), **overrides)


@pytest.mark.parametrize("kw, match", [
    ({"rollout.mode": "fast"}, "mode"),
    ({"rollout.engine": "vllm"}, "engine"),
    ({"rollout.mode": "sync", "rollout.max_staleness": 2}, "max_staleness=0"),
    ({"rollout.samples_per_prompt": 1}, ">= 2"),
    ({"rl.steps": 0}, "steps"),
    ({"rollout.staleness_policy": "ignore"}, "staleness_policy"),
    ({"rollout.max_staleness": 0, "rollout.publish_every": 3}, "dropped as stale"),
    ({"harness.context_budget": 100, "harness.max_turn_tokens": 64, "harness.observation_reserve": 64},
     "context_budget"),
    ({"tokenizer.vocab_size": 1024}, "vocab_size"),
    ({"sft.demo_accuracy": 0.0}, "demo_accuracy"),
    ({"sft.steps": 0}, "init_checkpoint"),
    ({"rollout.mode": "sync", "rollout.max_staleness": 0, "rollout.publish_every": 2}, "publish_every must be 1"),
    ({"rl.rows_per_step": -1}, "rows_per_step"),
    # 4 groups x 8 trajectories = 32 rows, but one group of 8 five-segment chains needs 40.
    ({"harness.max_segments": 5}, "set rl.rows_per_step >= 40"),
    ({"harness.context_budget": 8192, "model.max_position_embeddings": 4096},
     r"harness.context_budget=8192 exceeds the model's positions \(model.max_position_embeddings=4096\)"),
])
def test_bad_run_config_is_a_clear_error(kw, match):
  with pytest.raises(ValueError, match=match):
    _cfg(**kw)


def test_unknown_engine_lists_the_registry():
  with pytest.raises(ValueError, match=r"valid: \['jax', 'sglang'\]"):
    _cfg(**{"rollout.engine": "vllm"})


def test_sync_with_zero_staleness_is_valid():
  assert _cfg(**{"rollout.mode": "sync", "rollout.max_staleness": 0}).batch_rows == 4 * 8


def test_wilson_interval_matches_hand_computation():
  # 80/100: centre = (0.8 + 1.96²/200) / (1 + 1.96²/100), half = 1.96·sqrt(0.0016 + 1.96²/40000) / (1 + 1.96²/100)
  z = 1.96
  d = 1 + z * z / 100
  centre, half = (0.8 + z * z / 200) / d, z * math.sqrt(0.8 * 0.2 / 100 + z * z / 40000) / d
  lo, hi = evaluate.wilson(80, 100)
  assert lo == pytest.approx(centre - half) and hi == pytest.approx(centre + half)
  assert lo == pytest.approx(0.7112, abs=1e-4) and hi == pytest.approx(0.8666, abs=1e-4)
  assert evaluate.wilson(0, 10)[0] == 0.0 and evaluate.wilson(10, 10)[1] == 1.0
  with pytest.raises(ValueError, match="n > 0"):
    evaluate.wilson(0, 0)


def test_publish_roundtrip_and_pruning(tmp_path):
  params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.ones(4, np.int32)}}
  assert weight_files.latest(str(tmp_path)) is None
  for v in range(5):
    weight_files.publish(str(tmp_path), {"a": params["a"] + v, "b": params["b"]}, v, keep=2)
  version, path = weight_files.latest(str(tmp_path))
  assert version == 4
  got = weight_files.load(path, params)
  np.testing.assert_array_equal(got["a"], params["a"] + 4)
  np.testing.assert_array_equal(got["b"]["c"], params["b"]["c"])
  assert sorted(p.name for p in tmp_path.glob("v*.npz")) == ["v3.npz", "v4.npz"]
  with pytest.raises(ValueError, match="shape"):
    weight_files.load(path, {"a": np.zeros((3, 2)), "b": params["b"]})
  with pytest.raises(ValueError, match="no leaf"):
    weight_files.load(path, {"x": params["a"]})


def test_rl_main_config_converts_and_typos_fail():
  c = rl_configs.get_config("test,mode=sync")
  cfg = configs.from_dict(RunConfig, c, workdir="/tmp/x")
  assert cfg.rollout.mode == "sync" and cfg.rollout.max_staleness == 0
  assert cfg.rl.loss.kl_coef == c.rl.loss.kl_coef and cfg.rl.router_replay is True
  assert cfg.rl.loss.adv_eps == c.rl.loss.adv_eps and cfg.rl.loss.norm_constant is None   # every LossConfig key
  assert cfg.harness.seed == cfg.seed and cfg.harness.system_prompt.startswith("Fix the code")
  c.rl.loss.unlock()
  c.rl.loss.klcoef = 0.1
  with pytest.raises(ValueError, match=r"rl\.loss\.klcoef .*valid keys: \['adv_eps'"):
    configs.from_dict(RunConfig, c, workdir="/tmp/x")
  with pytest.raises(ValueError, match="unknown rl variant"):
    rl_configs.get_config("huge")


def test_the_trainer_scores_at_the_rollout_temperature_a_flag_sets():
  """--config.harness.sampling.temperature=0.7 sets rl.temperature too (derived: one value, two readers)."""
  c = rl_configs.get_config("colab")
  c.harness.sampling.temperature = 0.7            # what the flag does
  cfg = configs.from_dict(RunConfig, c, workdir="/tmp/x")
  assert cfg.rl.temperature == cfg.harness.sampling.temperature == 0.7
  assert _cfg(**{"harness.sampling.temperature": 0.7}).rl.temperature == 0.7   # no config can set them apart
  greedy = _cfg(**{"harness.sampling.temperature": 0.0})   # greedy rollouts: engines record T = 1 logprobs
  assert greedy.rl.temperature == 1.0


@pytest.mark.parametrize("variant", ["recipe", "colab", "curriculum"])
def test_every_sweep_entry_builds_a_valid_run_config(variant):
  base = configs.from_dict(RunConfig, rl_configs.get_config(variant), workdir="/tmp/x")
  for overrides in rl_configs.get_sweep(variant):
    common.override(rl_configs.get_config(variant), overrides)   # as --config.<key>=<value>: a key it lacks raises
    cfg = configs.replace(base, **overrides)          # the same dotted keys as --config.<key>=<value>
    for k, v in overrides.items():
      node = cfg
      for p in k.split("."):
        node = getattr(node, p)
      assert node == v, k
    assert cfg.model.vocab_size == 512


def test_colab_level1_is_todays_colab_recipe():
  a, b = rl_configs.get_config("colab"), rl_configs.get_config("colab_level1")
  assert a.to_dict() == b.to_dict() and b.tasks.levels == (1,)


def test_sft_demo_accuracy_sets_the_share_of_near_miss_demonstrations():
  pool = procedural.generate(400, seed=1, level=1)
  assert not any(t.metadata.get("near_miss") for t in warmstart.sft_tasks(_cfg(**{"sft.tasks": 300}).sft_plan, pool))
  tasks = warmstart.sft_tasks(_cfg(**{"sft.tasks": 300, "sft.demo_accuracy": 0.5}).sft_plan, pool)
  assert [t.id for t in tasks] == [t.id for t in pool[-300:]]
  misses = sum(bool(t.metadata.get("near_miss")) for t in tasks)
  assert 120 <= misses <= 180, misses   # binomial(300, 0.5): ±3.5 sd


def test_publisher_and_source_registries_list_valid_names():
  from composer_jax.rl import publishers, sources
  with pytest.raises(ValueError, match=r"unknown publisher 'npz'; valid: \['files', 'fleet', 'in_place'\]"):
    publishers.publisher_class("npz")
  assert publishers.publisher_name(_cfg()) == "files"
  assert publishers.publisher_name(_cfg(**{"rollout.mode": "sync", "rollout.max_staleness": 0})) == "in_place"
  assert publishers.publisher_name(_cfg(**{"rollout.engine": "sglang"})) == "fleet"
  with pytest.raises(ValueError, match="no worker processes"):
    publishers.follow(_cfg(**{"rollout.mode": "sync", "rollout.max_staleness": 0}))
  assert sorted(sources.SOURCES) == ["async", "sync"]
  with pytest.raises(ValueError, match="needs an in-process engine"):
    sources.InProcess(_cfg(**{"rollout.mode": "sync", "rollout.max_staleness": 0}), None, None, None)


def test_worker_throttle_allows_per_version_groups_then_waits_for_a_newer_version():
  from composer_jax.rl import follower
  from composer_jax.rl import worker_process as worker
  state = {"version": 0, "loads": 0}

  def load_newer():
    state["loads"] += 1
    if state["loads"] == 5:          # the trainer publishes v1 while the worker waits
      state["version"] = 1

  follows = follower.Follower(engine=None, version=lambda: state["version"], load_newer=load_newer)
  refresh = worker.throttle(follows, per_version=2, stopping=lambda: False)
  refresh()
  refresh()
  assert state["loads"] == 2 and state["version"] == 0      # two groups of v0 without waiting
  refresh()                                                  # a third one waits until v1 arrives
  assert state["version"] == 1 and state["loads"] == 5
  stopped = worker.throttle(follows, per_version=1, stopping=lambda: True)
  stopped()
  stopped()                                                  # a stopping worker is never held back


def test_checkpointer_saves_the_queue_cursor_with_the_state(tmp_path):
  import jax

  from composer_jax.train import checkpoint
  ck = checkpoint.Checkpointer(str(tmp_path), keep=2, async_save=False)
  state = {"w": np.arange(4.0)}
  ck.save(3, state, meta={"cursor": {"worker0": 7}}, force=True)
  ck.wait()
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  np.testing.assert_array_equal(ck.restore(like)["w"], state["w"])
  assert ck.restore_meta() == {"cursor": {"worker0": 7}} and ck.latest_step() == 3
  ck.close()


def test_success_rate_runs_through_the_evaluation_runner_and_resumes(tmp_path):
  from rollout import harness
  from rollout.engines import scripted
  from rollout.tasks.environment import EnvironmentCache
  from rollout.workspace import make_factory
  tasks = procedural.generate(4, seed=5, split="heldout", level=1)
  tok = setup.fit_tokenizer(tasks, harness.SHORT_SYSTEM_PROMPT, 512)
  hcfg = harness.HarnessConfig(system_prompt="short", context_budget=512, max_turn_tokens=128,
                               observation_reserve=128, max_turns=4, max_segments=1)
  envs = EnvironmentCache(make_factory("local"))
  try:
    got = evaluate.success_rate(scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks)), tok, tasks, envs, hcfg,
                                0.0, str(tmp_path / "oracle"))
    lo, hi = evaluate.wilson(4, 4)
    assert {k: got[k] for k in ("success", "ci_low", "ci_high", "n")} == {"success": 1.0, "ci_low": lo, "ci_high": hi,
                                                                          "n": 4}
    assert len(open(tmp_path / "oracle" / "results.jsonl").readlines()) == 4
    noop = scripted.ScriptedEngine(tok, scripted.noop_policy)   # finished tasks are read back, not re-run
    assert evaluate.success_rate(noop, tok, tasks, envs, hcfg, 0.0, str(tmp_path / "oracle"))["success"] == 1.0
  finally:
    envs.factory.close()


def test_a_step_takes_whole_groups_until_the_next_does_not_fit(tmp_path):
  """Self-summarising chains take a row per segment: a step holds up to groups_per_step whole groups within
  batch_rows, and a group that does not fit in what is left opens the next step (it is never an error, and the
  trainer does not wait for rows that cannot come)."""
  from composer_jax.rl import sources
  from rollout.queue import QueueConsumer, QueueProducer
  from rollout.staleness import StalenessConfig

  def traj(n_segments):
    seg = {"tokens_T": np.arange(6, dtype=np.int32), "gen_mask_T": np.ones(6, np.int8),
           "logprobs_T": np.zeros(6, np.float32), "versions_T": np.zeros(6, np.int32),
           "routed_TxNxK": np.zeros((6, 1, 1), np.int32), "prompt_len": 0, "turns": []}
    return {"task_id": "t", "segments": [seg] * n_segments, "reward": 1.0, "breakdown": {}}

  cfg = _cfg(**{"rl.groups_per_step": 4, "rollout.samples_per_prompt": 2, "harness.max_segments": 3,
                "rl.rows_per_step": 8})
  url = f"file://{tmp_path}/q"
  producer = QueueProducer(url, "w")
  for n_seg in (3, 1, 2, 3, 1, 1, 1, 1, 1):     # groups of 2 trajectories: 1 + n_seg rows each
    producer.append_group([traj(n_seg), traj(1)], policy_version=0)
  consumer = QueueConsumer(url, StalenessConfig(max_staleness=5))
  steps = [[g.key.n_rows for g in sources.take_groups(consumer, cfg, 0)] for _ in range(3)]
  assert steps == [[4, 2], [3, 4], [2, 2, 2, 2]]   # within 8 rows, in queue order; then 4 groups of 2


def test_level_pass_rates_per_step(tmp_path):
  """metrics.jsonl's per-level learning curve: the solved share of a step's trajectories, per task level."""
  from composer_jax.rl import trainer
  from rollout.queue import QueueConsumer, QueueProducer
  url = f"file://{tmp_path}/q"
  producer = QueueProducer(url, "w")

  def traj(solved):
    seg = {"tokens_T": np.arange(4, dtype=np.int32), "gen_mask_T": np.ones(4, np.int8),
           "logprobs_T": np.zeros(4, np.float32), "versions_T": np.zeros(4, np.int32), "prompt_len": 0, "turns": []}
    return {"task_id": "t", "segments": [seg], "reward": float(solved), "metrics": {"solved": float(solved)},
            "breakdown": {}}
  producer.append_group([traj(1), traj(0)], level=1)
  producer.append_group([traj(1), traj(1)], level=1)
  producer.append_group([traj(0), traj(1), traj(0), traj(0)], level=3)
  producer.append_group([traj(1), traj(1)], level=None)      # a task without a level: not in any curve
  groups = QueueConsumer(url).poll(0)
  assert trainer.level_pass_rates(groups) == {"pass/level_1": 0.75, "pass/level_3": 0.25}


def test_the_sft_control_reuses_the_warm_starts_transcripts(tmp_path, monkeypatch):
  """The control trains on the warm start's demonstrations as written in workdir/sft, without re-running the
  oracle; the warm start itself (no saved transcripts yet) produces them."""
  cfg = _cfg(workdir=str(tmp_path))
  os.makedirs(tmp_path / "sft")
  train, dev = [[{"role": "user", "content": "a"}]], [[{"role": "user", "content": "b"}]]
  seen = {}
  monkeypatch.setattr(warmstart, "run_sft", lambda *a, **k: seen.setdefault("args", a) and (None, {}))
  monkeypatch.setattr(warmstart, "sft_transcripts", lambda *a: (train, dev))
  run = setup.Run(None, [], [], [], None, str(tmp_path), False, None, ShardingRules())
  warmstart.sft(cfg.sft_plan, run, None, str(tmp_path / "sft"), steps=1, learning_rate=1.0, seed=0)
  assert seen.pop("args")[2:4] == (train, dev)
  warmstart.write_jsonl(str(tmp_path / "sft" / "sft_train.jsonl"), [[{"role": "user", "content": "saved"}]])
  warmstart.write_jsonl(str(tmp_path / "sft" / "sft_eval.jsonl"), dev)
  monkeypatch.setattr(warmstart, "sft_transcripts", lambda *a: pytest.fail("the control re-ran the oracle"))
  warmstart.sft(cfg.sft_plan, run, None, str(tmp_path / "sft_control"), steps=1, learning_rate=1.0, seed=0)
  assert seen["args"][2:4] == ([[{"role": "user", "content": "saved"}]], dev)


def test_a_curriculum_trains_its_levels_first_then_every_level_from_there(tmp_path, monkeypatch):
  """sft.curriculum_levels: stage 1 (workdir/sft_curriculum) trains curriculum_steps on those levels' demonstrations
  only; the warm start continues from its params on every level's, with the oracle run once per task."""
  d = rl_configs.get_config("colab")
  d.tasks.levels, d.sft.demo_accuracy = (1, 2), 1.0
  d.sft.update(curriculum_levels=(1,), curriculum_steps=7, steps=5)
  cfg = configs.from_dict(RunConfig, d, workdir=str(tmp_path))
  pool = [types.SimpleNamespace(id=f"t{i}", metadata={"level": 1 + i % 2}) for i in range(6)]
  dev = [types.SimpleNamespace(id=f"d{i}", metadata={"level": 1 + i % 2}) for i in range(4)]
  oracle, trained = [], []

  def run_sft(model_cfg, tok, train, heldout, workdir, *, steps, init_params, **kw):
    os.makedirs(workdir, exist_ok=True)
    warmstart.write_jsonl(os.path.join(workdir, "sft_train.jsonl"), train)
    warmstart.write_jsonl(os.path.join(workdir, "sft_eval.jsonl"), heldout)
    trained.append((os.path.basename(workdir), steps, init_params, [m[0]["content"] for m in train],
                    [m[0]["content"] for m in heldout]))
    return f"params of {os.path.basename(workdir)}", {}
  monkeypatch.setattr(warmstart, "oracle_transcripts", lambda tok, tasks, *a, **k: oracle.extend(t.id for t in tasks)
                      or [[{"role": "user", "content": t.id}] for t in tasks])
  monkeypatch.setattr(warmstart, "run_sft", run_sft)
  run = setup.Run(None, pool, [], dev, None, str(tmp_path), False, None, ShardingRules())
  assert warmstart.warm_start(cfg.sft_plan, run, log_fn=lambda s: None) == "params of sft"
  level1, level2 = ["t0", "t2", "t4"], ["t1", "t3", "t5"]
  assert trained == [("sft_curriculum", 7, None, level1, ["d0", "d2"]),
                     ("sft", 5, "params of sft_curriculum", level1 + level2, ["d0", "d2", "d1", "d3"])]
  assert sorted(oracle) == sorted(t.id for t in pool + dev)   # each demonstration made once


def test_a_warm_start_resumes_after_its_last_finished_stage(tmp_path, monkeypatch):
  """A finished stage is not redone: after the curriculum's first stage the SFT on every level continues from its
  exported params (not the init checkpoint's); after the last stage the start is its params, loaded."""
  d = rl_configs.get_config("colab")
  d.tasks.levels, d.sft.demo_accuracy = (1, 2), 1.0
  d.sft.update(curriculum_levels=(1,), curriculum_steps=7, steps=5, init_checkpoint="/init")
  cfg = configs.from_dict(RunConfig, d, workdir=str(tmp_path))
  loaded, trained = [], []
  monkeypatch.setattr(warmstart.stages, "load_params", lambda path, *a: loaded.append(path) or f"loaded {path}")
  monkeypatch.setattr(warmstart, "sft", lambda plan, run, init, stage, **k: trained.append((stage, init)) or
                      (f"params of {os.path.basename(stage)}", {}))
  run = setup.Run(None, [], [], [], None, str(tmp_path), False, None, ShardingRules())
  os.makedirs(tmp_path / "sft_curriculum" / "params")
  assert warmstart.warm_start(cfg.sft_plan, run, log_fn=lambda s: None) == "params of sft"
  assert loaded == []   # the stage loads the params it starts from (`run_sft`)
  assert trained == [(str(tmp_path / "sft"), str(tmp_path / "sft_curriculum"))]
  os.makedirs(tmp_path / "sft" / "params")
  assert warmstart.warm_start(cfg.sft_plan, run, log_fn=lambda s: None) == f"loaded {tmp_path / 'sft'}"
  assert len(trained) == 1


@pytest.mark.parametrize("curriculum", [True, False])
def test_the_tokenizer_is_fitted_to_the_curriculums_first_levels(tmp_path, monkeypatch, curriculum):
  """Fitted to the first sft.tasks training tasks, and with a curriculum to those of its first levels only."""
  d = rl_configs.get_config("curriculum")
  if not curriculum:
    d.sft.update(curriculum_levels=(), curriculum_steps=0)
  d.sft.tasks = 256
  cfg = configs.from_dict(RunConfig, d, workdir=str(tmp_path))
  pool = [types.SimpleNamespace(id=f"t{i}", metadata={"level": 1 + i % 2}) for i in range(300)]
  fitted = []
  monkeypatch.setattr(setup, "fit_tokenizer", lambda tasks, *a: fitted.append([t.id for t in tasks]) or "tok")
  monkeypatch.setattr(setup.tokenizer_lib, "save_tokenizer", lambda tok, path: None)
  assert setup.run_tokenizer(cfg, pool) == "tok"
  assert fitted == [[t.id for t in pool[:256] if not curriculum or t.metadata["level"] == 1]]


@pytest.mark.parametrize("sft, levels, match", [
    ({"curriculum_levels": (1,)}, (1, 2), "needs both"),
    ({"curriculum_steps": 9}, (1, 2), "needs both"),
    ({"curriculum_levels": (1, 2), "curriculum_steps": 9}, (1, 2), "some, not all"),
    ({"curriculum_levels": (3,), "curriculum_steps": 9}, (1, 2), "some, not all"),
])
def test_a_curriculum_must_be_some_of_the_levels_with_steps(sft, levels, match):
  d = rl_configs.get_config("colab")
  d.tasks.levels = levels
  d.sft.update(sft)
  with pytest.raises(ValueError, match=match):
    configs.from_dict(RunConfig, d, workdir="/tmp/x")


def test_run_experiment_evaluates_the_summary_rows_at_the_same_budget(tmp_path, monkeypatch):
  """eval.summaries_from_start and eval.drop_oldest: RL is evaluated also with the start writing its summaries
  and with no summaries (oldest turns dropped), on the same tasks and context budget; results.json has each row."""
  from composer_jax.rl import experiment
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("recipe"), workdir=str(tmp_path))
  (tmp_path / "sft").mkdir()
  calls = []

  def evaluate_at_temperatures(c, params, run, tasks, name, summarizer_params=None):
    calls.append((name, params, summarizer_params, c.harness.overflow, c.harness.max_segments,
                  c.harness.context_budget, [t.id for t in tasks]))
    return {"T0": {"success": 0.5}}

  monkeypatch.setattr(experiment, "evaluate_at_temperatures", evaluate_at_temperatures)
  monkeypatch.setattr(experiment.warmstart, "warm_start", lambda c, run, log: "start")
  monkeypatch.setattr(experiment.loop, "train_rl",
                      lambda c, start, run, log: {"params": "rl", "last": {}, "resumed_at": 0})
  monkeypatch.setattr(experiment, "sft_control", lambda *a: "control")
  tasks = [types.SimpleNamespace(id=f"L{lv}", metadata={"level": lv}) for lv in (1, 2, 3)]
  fake_run(monkeypatch, heldout=tasks)
  # the RL steps' metrics: a length term that was always on, a todo term that never fired, in quarters of 2 steps
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(
      {"step": s, "reward": 0.1 * s, "reward/task": 0.1 * s + 0.03, "reward/length": -0.03, "reward/todo": 0.0,
       "pass_rate": 0.1 * s}) + "\n" for s in range(1, 9)))
  result = experiment.run_experiment(cfg, log_fn=lambda s: None)
  want = {"reward": [0.15, 0.35, 0.55, 0.75], "reward/task": [0.18, 0.38, 0.58, 0.78], "reward/length": [-0.03] * 4}
  assert set(result["reward_terms"]) == set(want)
  assert all(result["reward_terms"][k] == pytest.approx(v) for k, v in want.items())
  budget, every, level3 = cfg.harness.context_budget, ["L1", "L2", "L3"], ["L3"]   # only level 3 summarises
  at = f"@{cfg.rl.steps}"   # what depends on the RL policy is named by its step count
  assert calls == [("sft", "start", None, "summarize", 4, budget, every),
                   ("rl" + at, "rl", None, "summarize", 4, budget, every),
                   ("sft_control" + at, "control", None, "summarize", 4, budget, every),
                   ("rl_start_summaries" + at, "rl", "start", "summarize", 4, budget, level3),
                   ("rl_drop_oldest" + at, "rl", None, "drop_oldest", 8, budget, level3)]
  saved = json.load(open(tmp_path / "results.json"))
  assert {"rl_start_summaries", "rl_drop_oldest"} <= set(saved) and saved["rl_drop_oldest"] == result["rl_drop_oldest"]
  assert {"eval_rl_start_summaries", "eval_rl_drop_oldest"} <= set(saved["phase_seconds"])
  tasks[:] = tasks[:2]   # no held-out task of a summary level: an error before any summary row runs
  calls.clear()
  with pytest.raises(ValueError, match=r"eval.summary_levels=\(3,\) matches none of the 2 held-out tasks"):
    experiment.run_experiment(cfg, log_fn=lambda s: None)
  assert [c[0] for c in calls] == ["sft", "rl" + at, "sft_control" + at]


def test_start_only_evaluates_the_warm_start_and_trains_nothing_after_it(tmp_path, monkeypatch):
  """eval.start_only (calibration before a long run): the start is evaluated on every held-out task, no RL step,
  no control and no summary row runs, and results.json says so."""
  from composer_jax.rl import experiment
  d = rl_configs.get_config("recipe")
  d.eval.start_only = True
  cfg = configs.from_dict(RunConfig, d, workdir=str(tmp_path))
  (tmp_path / "sft").mkdir()
  calls = []

  class Envs:
    class factory:
      close = staticmethod(lambda: calls.append("closed"))
  monkeypatch.setattr(experiment, "evaluate_at_temperatures",
                      lambda c, params, run, tasks, name, **k: calls.append((name, params, len(tasks))) or
                      {"T1": {"success": 0.25}})
  monkeypatch.setattr(experiment.warmstart, "warm_start", lambda c, run, log: "start")
  monkeypatch.setattr(experiment.loop, "train_rl", lambda c, start, run, log: pytest.fail("RL ran in a start-only run"))
  monkeypatch.setattr(experiment, "sft_control", lambda *a: pytest.fail("the control ran in a start-only run"))
  fake_run(monkeypatch, heldout=[types.SimpleNamespace(id=f"L{lv}", metadata={"level": lv}) for lv in (1, 2, 3)],
           envs=Envs)
  result = experiment.run_experiment(cfg, log_fn=lambda s: None)
  assert calls == [("sft", "start", 3), "closed"]
  saved = json.load(open(tmp_path / "results.json"))
  assert saved == result and saved["sft"] == {"T1": {"success": 0.25}} and saved["start_only"] is True
  assert (saved["sft_steps"], saved["sft_tasks"], saved["sft_curriculum_steps"], saved["eval_tasks"]) == \
      (cfg.sft.steps, cfg.sft.tasks, 0, 3)
  assert not {"rl", "sft_control", "rl_start_summaries", "rl_drop_oldest", "reward_terms"} & set(saved)
  assert set(saved["phase_seconds"]) == {"sft_start", "eval_sft", "total"} and "earlier_phase_seconds" not in saved
  again = experiment.run_experiment(cfg, log_fn=lambda s: None)   # a rerun keeps what the first one took
  assert again["earlier_phase_seconds"] == [saved["phase_seconds"]]
  third = experiment.run_experiment(cfg, log_fn=lambda s: None)
  assert third["earlier_phase_seconds"] == [saved["phase_seconds"], again["phase_seconds"]]
  assert json.load(open(tmp_path / "results.json")) == third


@pytest.mark.parametrize("kind, levels", [("procedural", (1, 2)), ("mined", (1, 2, 3))])
def test_summary_levels_must_be_levels_of_the_task_source(kind, levels):
  d = rl_configs.get_config("recipe")
  d.tasks.update(kind=kind, levels=levels, repos=("/src/a",) if kind == "mined" else ())
  with pytest.raises(ValueError, match="eval.summary_levels=.*does not have"):
    configs.from_dict(RunConfig, d, workdir="/tmp/x")
