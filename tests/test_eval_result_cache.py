"""The cross-run result cache: a deterministic engine evaluated again with the same weights, tasks and settings is
read back (no episode runs), under any policy name; any difference in those runs it again; nondeterministic
records and engines are never kept."""
import dataclasses
import json

import jax
import pytest

from composer_jax import model
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from composer_jax.train import tokenizer as tokenizer_lib
from rollout import harness
from rollout.evaluation import policies, result_cache, runner
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import LocalFactory
from tests.test_sampling_engine import CFG as TINY

CFG = harness.HarnessConfig(context_budget=2048, max_turn_tokens=768, observation_reserve=256, max_turns=8)


@pytest.fixture(scope="module")
def tok():
  texts = [f for t in procedural.generate(40, level=1) for f in t.environment.files.values()]
  return tokenizer_lib.train_tokenizer(texts + [harness.SYSTEM_PROMPT], tokenizer_lib.TokenizerConfig(500))


class Keyed:
  """The scripted oracle, declaring itself deterministic under `key`, counting its generate calls."""

  def __init__(self, tok, tasks, key="k1"):
    self.inner, self.key, self.calls = policies.baseline("oracle", tok, tasks), key, 0

  def generate(self, requests):
    self.calls += 1
    return self.inner.generate(requests)

  def result_key(self):
    return self.key


def test_a_second_evaluation_is_read_back(tmp_path, tok):
  tasks = procedural.generate(3, seed=1, split="heldout")
  envs = EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  store, lines = str(tmp_path / "cache"), []
  first = Keyed(tok, tasks)
  a = runner.run_policy("sft", first, tok, tasks, envs, CFG, str(tmp_path / "run1"), cache_dir=store,
                        log=lines.append)
  assert first.calls > 0 and len(list((tmp_path / "cache").iterdir())) == 1
  again = Keyed(tok, tasks)
  b = runner.run_policy("start", again, tok, tasks, envs, CFG, str(tmp_path / "run2"), cache_dir=store,
                        log=lines.append)
  assert again.calls == 0 and "read from the result cache" in lines[-1]
  assert [dict(r, policy="sft") for r in b] == a and {r["policy"] for r in b} == {"start"}
  assert runner.read_records(str(tmp_path / "run2")) == {r["task_id"]: r for r in b}   # written like a run's
  # Other weights, other settings, another tokenizer or no cache: run again.
  for engine, hcfg, store_arg in [(Keyed(tok, tasks, key="k2"), CFG, store),
                                  (Keyed(tok, tasks), dataclasses.replace(CFG, max_turns=7), store),
                                  (Keyed(tok, tasks), CFG, "")]:
    out = str(tmp_path / f"run_{engine.key}_{hcfg.max_turns}_{bool(store_arg)}")
    runner.run_policy("sft", engine, tok, tasks, envs, hcfg, out, cache_dir=store_arg, log=lambda s: None)
    assert engine.calls > 0
  assert len(list((tmp_path / "cache").iterdir())) == 3


def test_the_environment_variable_turns_it_on_and_unkeyed_engines_are_not_kept(tmp_path, tok, monkeypatch):
  tasks = procedural.generate(2, seed=2, split="heldout")
  envs = EnvironmentCache(LocalFactory(root=str(tmp_path / "ws")))
  monkeypatch.setenv(result_cache.ENV, str(tmp_path / "env_cache"))
  runner.run_policy("oracle", policies.baseline("oracle", tok, tasks), tok, tasks, envs, CFG, str(tmp_path / "a"),
                    log=lambda s: None)
  assert not (tmp_path / "env_cache").exists()
  runner.run_policy("sft", Keyed(tok, tasks), tok, tasks, envs, CFG, str(tmp_path / "b"), log=lambda s: None)
  assert len(list((tmp_path / "env_cache").iterdir())) == 1


def test_records_with_a_grading_timeout_are_not_kept(tmp_path):
  timed_out = [{"task_id": "a", "policy": "p", "samples": [{"grade_timed_out": True}]}]
  ok = [{"task_id": "a", "policy": "p", "samples": [{"grade_timed_out": False}]}]
  assert not result_cache.save(str(tmp_path), "k", timed_out)
  assert result_cache.load(str(tmp_path), "k", "q") is None
  assert result_cache.save(str(tmp_path), "k", ok)
  assert result_cache.load(str(tmp_path), "k", "q") == [dict(ok[0], policy="q")]
  assert json.loads((tmp_path / "k.jsonl").read_text()) == ok[0]


def test_jax_engine_result_key_follows_weights_and_settings():
  params = model.init(jax.random.key(0), TINY)
  eng = JaxEngine(params, TINY)
  key = eng.result_key()
  assert JaxEngine(params, TINY).result_key() == key
  assert JaxEngine(params, TINY, EngineConfig(min_len_bucket=32)).result_key() != key
  assert JaxEngine(model.init(jax.random.key(1), TINY), TINY).result_key() != key
  eng.update_weights(model.init(jax.random.key(1), TINY), policy_version=1)
  assert eng.result_key() != key
