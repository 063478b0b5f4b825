"""Faults in the middle of a group: a grader that times out, a sandbox that does not start.

The group is rolled out again whole or dropped whole, each case is counted in the queue (the trainer's metrics)
and a timed-out grade never reaches the trainer as a reward of 0. Real timeouts: the grading command sleeps past
its limit in a real (local) workspace."""
import dataclasses
import itertools
import threading

import pytest

from composer_jax.rl import setup
from rollout import harness, workers
from rollout.engines import scripted
from rollout.queue import QueueConsumer, QueueProducer
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import make_factory

real_grade = harness.grade


@pytest.fixture(scope="module")
def setting():
  pool = procedural.generate(4, seed=5, level=1)
  tok = setup.fit_tokenizer(pool, harness.SHORT_SYSTEM_PROMPT, 512)
  hcfg = harness.HarnessConfig(system_prompt=harness.SHORT_SYSTEM_PROMPT, context_budget=512, max_turn_tokens=128,
                               observation_reserve=128, max_turns=4, max_segments=1)
  factory = make_factory("local")
  yield pool, tok, factory, hcfg
  factory.close()


def _slow(tests):
  """The same hidden tests, behind a sleep past their (shortened) time limit: a real grading timeout."""
  return dataclasses.replace(tests, command="sleep 3; " + tests.command, timeout_s=0.5)


def _run(setting, tmp_path, pool=None, envs=None, **wcfg):
  all_tasks, tok, factory, hcfg = setting
  pool = pool or all_tasks
  url, lines = f"file://{tmp_path}/q", []
  cfg = workers.WorkerConfig(samples_per_prompt=3, **wcfg)
  n = workers.run_worker(scripted.ScriptedEngine(tok, scripted.oracle_policy(all_tasks)), tok, pool,
                         envs or EnvironmentCache(factory), hcfg, QueueProducer(url, cfg.producer_id), cfg,
                         str(tmp_path / "w0.json"), log_fn=lines.append)
  consumer = QueueConsumer(url)
  return n, consumer.poll(policy_version=0), consumer.stats(), lines


def test_a_grade_timing_out_mid_group_reruns_the_whole_group_once(setting, tmp_path, monkeypatch):
  calls, lock = itertools.count(), threading.Lock()

  def second_grade_times_out(ws, tests, **kwargs):
    with lock:
      i = next(calls)
    return real_grade(ws, _slow(tests) if i == 1 else tests, **kwargs)

  monkeypatch.setattr(harness, "grade", second_grade_times_out)
  pool = setting[0]
  n, got, stats, lines = _run(setting, tmp_path, max_groups=2)
  assert n == 2 and [g.tree()["meta"]["task_id"] for g in got] == [pool[0].id, pool[1].id]
  assert [g.tree()["meta"]["attempts"] for g in got] == [2, 1]
  for g in got:                                 # whole groups, every grade real: the oracle solves each sample
    trajs = g.trajectories()
    assert len(trajs) == 3 and all(t["metrics"]["grade_timed_out"] == 0.0 for t in trajs)
    assert all(t["metrics"]["solved"] == 1.0 and t["reward"] > 0 for t in trajs)
  assert (stats["grade_timeouts"], stats["groups_retried"], stats.get("groups_dropped", 0)) == (1, 1, 0)
  assert any("1/3 grades" in s and "grade_timeouts" in s for s in lines)


def test_a_task_whose_grader_always_times_out_is_dropped_whole_and_counted(setting, tmp_path):
  pool = setting[0]
  stuck = dataclasses.replace(pool[0], id="stuck", tests=_slow(pool[0].tests))
  n, got, stats, lines = _run(setting, tmp_path, pool=[stuck, pool[1], pool[2]], max_groups=2)
  # The stuck task's group never reaches the queue (no reward-0 samples to train on); the stream moves on.
  assert n == 2 and [g.tree()["meta"]["task_id"] for g in got] == [pool[1].id, pool[2].id]
  assert [g.tree()["meta"]["stream_index"] for g in got] == [1, 2]
  assert (stats["grade_timeouts"], stats["groups_dropped"]) == (2, 1)
  assert any("stuck" in s and "dropped after 2 tries" in s for s in lines)


class _FlakyEnvs(EnvironmentCache):
  """Forks fail on the calls listed in `fail_on` (a sandbox that does not start); records every workspace."""

  def __init__(self, factory, fail_on):
    super().__init__(factory)
    self.fail_on, self.calls, self.workspaces = set(fail_on), itertools.count(), []

  def fork(self, task):
    if next(self.calls) in self.fail_on:
      raise OSError("bwrap: cannot mount overlay: No space left on device")
    ws = super().fork(task)
    self.workspaces.append(ws)
    return ws


def test_a_sandbox_that_does_not_start_mid_group_reruns_the_group(setting, tmp_path):
  envs = _FlakyEnvs(setting[2], fail_on={1})    # the group's second episode
  n, got, stats, lines = _run(setting, tmp_path, envs=envs, max_groups=1)
  assert n == 1 and len(got) == 1 and got[0].tree()["meta"]["attempts"] == 2
  assert len(got[0].trajectories()) == 3
  assert (stats["sandbox_start_failures"], stats["groups_retried"]) == (1, 1)
  assert any("did not start" in s and "No space left" in s for s in lines)
  assert len(envs.workspaces) == 1 + 3 and all(ws.sb.closed for ws in envs.workspaces)   # nothing left running


def test_groups_that_keep_failing_stop_the_worker_with_a_clear_error(setting, tmp_path):
  envs = _FlakyEnvs(setting[2], fail_on=range(1000))
  with pytest.raises(workers.GroupsKeepFailing, match="3 groups in a row dropped; the last: .*did not start"):
    _run(setting, tmp_path, envs=envs, max_drops_in_a_row=3)
