"""Engine-agnostic rollout workers: groups reach the queue whole, streams interleave, a restart resumes."""
import json

import pytest

from composer_jax.rl import setup
from rollout import harness, workers
from rollout.engines import scripted
from rollout.queue import QueueConsumer, QueueProducer
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import make_factory


@pytest.fixture(scope="module")
def setting():
  pool = procedural.generate(6, seed=3, level=1)
  tok = setup.fit_tokenizer(pool, harness.SHORT_SYSTEM_PROMPT, 512)
  envs = EnvironmentCache(make_factory("local"))
  hcfg = harness.HarnessConfig(system_prompt=harness.SHORT_SYSTEM_PROMPT, context_budget=512, max_turn_tokens=128,
                               observation_reserve=128, max_turns=4, max_segments=1)
  yield pool, tok, envs, hcfg
  envs.factory.close()


def test_task_streams_of_two_workers_interleave_the_pool():
  pool = list(range(10))
  a, b = workers.WorkerConfig(0, 2), workers.WorkerConfig(1, 2)
  assert [workers.task_at(pool, a, i) for i in range(5)] == [0, 2, 4, 6, 8]
  assert [workers.task_at(pool, b, i) for i in range(6)] == [1, 3, 5, 7, 9, 1]
  with pytest.raises(ValueError, match="worker_index"):
    workers.WorkerConfig(2, 2)
  with pytest.raises(ValueError, match=">= 2"):
    workers.WorkerConfig(samples_per_prompt=1)


def test_worker_appends_whole_groups_and_resumes_after_restart(setting, tmp_path):
  pool, tok, envs, hcfg = setting
  engine = scripted.ScriptedEngine(tok, scripted.oracle_policy(pool))
  url, state = f"file://{tmp_path}/q", str(tmp_path / "w0.json")
  cfg = workers.WorkerConfig(samples_per_prompt=2, max_groups=2)
  assert workers.run_worker(engine, tok, pool, envs, hcfg, QueueProducer(url, cfg.producer_id), cfg, state) == 2
  assert json.load(open(state)) == {"next": 2}
  # A "restarted" worker (new producer object, same id and state file) continues with task 2, then 3.
  assert workers.run_worker(engine, tok, pool, envs, hcfg, QueueProducer(url, cfg.producer_id), cfg, state) == 2
  got = QueueConsumer(url).poll(trainer_version=0)
  assert [g.tree()["meta"]["task_id"] for g in got] == [t.id for t in pool[:4]]
  assert [g.tree()["meta"]["stream_index"] for g in got] == [0, 1, 2, 3]
  for g in got:
    trajs = g.trajectories()
    assert len(trajs) == 2 and all(t["metrics"]["solved"] == 1.0 for t in trajs)   # the oracle solves each


def test_worker_stops_when_asked(setting, tmp_path):
  pool, tok, envs, hcfg = setting
  engine = scripted.ScriptedEngine(tok, scripted.oracle_policy(pool))
  cfg = workers.WorkerConfig(samples_per_prompt=2)
  calls = []
  n = workers.run_worker(engine, tok, pool, envs, hcfg, QueueProducer(f"file://{tmp_path}/q", "worker0"), cfg,
                         str(tmp_path / "s.json"), refresh=lambda: calls.append(1),
                         should_stop=lambda: len(calls) >= 3)
  assert n == 3 and len(calls) == 3
  with pytest.raises(ValueError, match="non-empty"):
    workers.run_worker(engine, tok, [], envs, hcfg, None, cfg, str(tmp_path / "t.json"))
