"""rollout/harness.py: the loop with scripted, no-op and random engines; the token-level record; summarization."""

import dataclasses
import threading

import numpy as np
import pytest

from composer_jax.train import tokenizer as tokenizer_lib
from rollout import chat_format as cf
from rollout import harness
from rollout.engines import scripted
from rollout.engines.protocol import GenerateResult
from rollout.rewards import RewardConfig
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache
from rollout.trajectory import Trajectory
from rollout.workspace import LocalFactory

CFG = harness.HarnessConfig(context_budget=2048, max_turn_tokens=256, observation_reserve=256, max_turns=16)


@pytest.fixture(scope="module")
def tok():
  texts = [f for t in procedural.generate(100, level=4) for f in t.environment.files.values()]
  return tokenizer_lib.train_tokenizer(texts + [harness.SYSTEM_PROMPT], tokenizer_lib.TokenizerConfig(600))


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
  return EnvironmentCache(LocalFactory(root=str(tmp_path_factory.mktemp("ws"))))


@pytest.fixture(scope="module")
def tasks():
  return [t for level in (1, 2, 3, 4) for t in procedural.generate(2, seed=7, level=level)]


class CountingEngine:
  """Wraps an engine, recording batch sizes and optionally attaching fake routed experts."""

  def __init__(self, inner, routing: tuple[int, int] | None = None):
    self.inner, self.routing, self.batches = inner, routing, []

  def generate(self, requests):
    self.batches.append(len(requests))
    out = self.inner.generate(requests)
    if self.routing:
      out = [dataclasses.replace(r, routed_experts=np.arange(len(r.output_ids) * 6, dtype=np.int32).reshape(
        len(r.output_ids), *self.routing), policy_version=5) for r in out]
    return out


def test_oracle_solves_everything_noop_nothing(tok, envs, tasks):
  oracle = CountingEngine(scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks)))
  trajs = harness.run_episodes(oracle, tok, tasks, envs, CFG)
  assert [t.metrics["solved"] for t in trajs] == [1.0] * len(tasks), [t.metrics for t in trajs]
  for t in trajs:
    assert t.stop_reason == "finish" and t.breakdown["malformed"] == 0 and t.breakdown["todo"] == 0
    assert t.reward == pytest.approx(1.0)
  # One batched generate per step, shrinking as episodes finish.
  lengths = sorted(len(t.metadata["oracle"]) for t in tasks)
  assert oracle.batches == [sum(n > i for n in lengths) for i in range(lengths[-1])]
  noop = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.noop_policy), tok, tasks, envs, CFG)
  assert [t.reward for t in noop] == [0.0] * len(tasks)
  assert all(t.metrics["pass_fraction"] < 1 for t in noop)  # the fail-to-pass tests still fail


def _outcome(t: Trajectory) -> tuple:
  """Everything a trajectory holds but its timings."""
  return (t.task_id, t.reward, t.breakdown, {k: v for k, v in t.metrics.items() if not k.endswith("wall_s")},
          t.messages, t.stop_reason, [s.tokens_T.tolist() for s in t.segments])


@pytest.mark.parametrize("workers", [1, 4])
def test_episodes_are_graded_as_they_end_with_the_same_trajectories(tok, envs, tasks, monkeypatch, workers):
  """With `grade_early` an episode that ends is graded while the longer ones still generate (the oracle's level-1
  episodes end steps before its level-4 ones); without it, every grade waits for the last step. Either way, and
  with turns run one after another or at once (`tool_workers`), the trajectories are the same."""
  engine = CountingEngine(scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks)))
  graded_after = []   # per grade: how many generate calls had been made when it started
  close = harness._Episode.close_and_score
  monkeypatch.setattr(harness._Episode, "close_and_score",
                      lambda ep: graded_after.append(len(engine.batches)) or close(ep))
  runs = {}
  for early in (True, False):
    engine.batches.clear()
    graded_after.clear()
    cfg = dataclasses.replace(CFG, grade_workers=workers, grade_early=early, tool_workers=workers)
    runs[early] = [_outcome(t) for t in harness.run_episodes(engine, tok, tasks, envs, cfg)]
    steps = len(engine.batches)
    assert len(graded_after) == len(tasks)
    if early:
      assert min(graded_after) < steps - 1, graded_after   # level 1 graded before level 4's last generate
    else:
      assert set(graded_after) == {steps}
  assert runs[True] == runs[False]
  assert {o[1] for o in runs[True]} == {1.0}


def test_turns_of_a_step_run_at_once(tok, envs, tasks, monkeypatch):
  """With `tool_workers` > 1 the episodes' tool calls after a step run in threads at once: two calls meet at a
  barrier that one-at-a-time calls could never pass."""
  meet = threading.Barrier(2, timeout=10)
  call = harness.ToolBox.call

  def waiting(box, c):
    if c.name == "finish":   # both level-1 episodes finish at the same step
      meet.wait()
    return call(box, c)
  monkeypatch.setattr(harness.ToolBox, "call", waiting)
  level1 = [t for t in tasks if t.metadata.get("level") == 1]
  trajs = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.oracle_policy(level1)), tok, level1, envs,
                               dataclasses.replace(CFG, tool_workers=2))
  assert not meet.broken and [t.metrics["solved"] for t in trajs] == [1.0] * len(level1) == [1.0, 1.0]
  with pytest.raises(ValueError, match="tool_workers >= 1"):
    dataclasses.replace(CFG, tool_workers=0)


def test_token_record_matches_chat_format(tok, envs, tasks):
  """The harness builds the context incrementally; it must equal encoding the whole transcript at once, and the
  model-generated mask must equal chat_format's loss mask."""
  trajs = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks)), tok, tasks, envs, CFG)
  for t in trajs:
    (seg,) = t.segments
    messages = t.messages[:-1]  # the finish tool's result is not fed back: the episode is over
    ids, mask = cf.encode_messages(tok, messages)
    np.testing.assert_array_equal(seg.tokens_T, ids)
    np.testing.assert_array_equal(seg.gen_mask_T, mask)
    assert seg.prompt_len == len(cf.encode_messages(tok, messages[:2], add_generation_prompt=True)[0])
    assert (seg.turns_T[:seg.prompt_len] == -1).all() and seg.turns_T[-1] == len(seg.turns) - 1
    oracle = next(task.metadata["oracle"] for task in tasks if task.id == t.task_id)
    assert [turn["tools"] for turn in seg.turns] == [[c["name"] for c in turn["tool_calls"]] for turn in oracle]
    for turn in seg.turns:  # each turn's generated span is exactly its masked tokens
      assert seg.gen_mask_T[turn["start"]:turn["gen_end"]].all()
      assert not seg.gen_mask_T[turn["gen_end"]:turn["end"]].any()


def test_routing_versions_and_round_trip(tok, envs, tasks):
  engine = CountingEngine(scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks)), routing=(2, 3))
  (t,) = harness.run_episodes(engine, tok, tasks[:1], envs, CFG)
  seg = t.segments[0]
  gen = seg.gen_mask_T.astype(bool)
  assert seg.routed_TxNxK.shape == (len(seg.tokens_T), 2, 3)
  assert (seg.routed_TxNxK[~gen] == -1).all() and (seg.routed_TxNxK[gen] >= 0).all()
  assert (seg.versions_T[gen] == 5).all() and (seg.versions_T[~gen] == -1).all()
  back = Trajectory.from_dict(t.to_dict())
  for a, b in zip(back.segments, t.segments, strict=True):
    for f in ("tokens_T", "gen_mask_T", "logprobs_T", "versions_T", "turns_T", "routed_TxNxK"):
      np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
      assert getattr(a, f).dtype == getattr(b, f).dtype
  assert back.breakdown == t.breakdown and back.messages == t.messages


def test_random_policy_never_crashes_and_counts_malformed(tok, envs, tasks):
  cfg = dataclasses.replace(CFG, max_turn_tokens=64, max_turns=4)
  engine = scripted.RandomEngine(tok.get_vocab_size(), seed=1)
  trajs = harness.run_episodes(engine, tok, tasks * 2, envs, cfg)
  assert all(t.metrics["solved"] == 0.0 for t in trajs)
  assert sum(t.metrics["malformed_calls"] for t in trajs) > 0
  for t in trajs:
    assert t.breakdown["malformed"] == pytest.approx(-cfg.rewards.malformed_weight * t.metrics["malformed_calls"])
    assert t.stop_reason in ("finish", "max_turns")
    assert np.allclose(t.segments[0].logprobs_T[t.segments[0].gen_mask_T == 1], -np.log(tok.get_vocab_size()))


def test_behaviour_terms_are_charged(tok, envs, tasks):
  task = tasks[0]
  path = next(iter(task.environment.files))
  script = [
    {"content": "<|tool_call|>{not json<|/tool_call|>"},  # text spelling of the markers: plain text, not a call
    {"content": "", "tool_calls": [{"name": "explode", "arguments": {}}]},
    {"content": "", "tool_calls": [{"name": "read_file", "arguments": {"path": path}}]},
    {"content": "", "tool_calls": [{"name": "read_file", "arguments": {"path": path}}]},
    {"content": "", "tool_calls": [{"name": "todo", "arguments": {"add": ["a", "b"]}}]},
    {"content": "", "tool_calls": [{"name": "write_file", "arguments": {"path": "z.py", "content": "import os\n"}}]},
    {"content": "", "tool_calls": [{"name": "finish", "arguments": {}}]},
  ]

  def policy(text):
    return script[text.count(cf.ASSISTANT) - 1]

  rewards = RewardConfig(malformed_weight=0.1, repeat_weight=0.2, todo_weight=0.3, no_message_weight=0.4,
                         lint_weight=0.5)
  (t,) = harness.run_episodes(scripted.ScriptedEngine(tok, policy), tok, [task], envs,
                              dataclasses.replace(CFG, rewards=rewards))
  # Turn 1 spelled the markers as text: no call, so the episode would end; check that is what happened.
  assert t.stop_reason == "finish" and t.metrics["turns"] == 1 and t.metrics["tool_calls"] == 0
  script.pop(0)
  (t,) = harness.run_episodes(scripted.ScriptedEngine(tok, policy), tok, [task], envs,
                              dataclasses.replace(CFG, rewards=rewards))
  assert t.metrics["malformed_calls"] == 1 and t.metrics["repeated_calls"] == 1
  assert t.metrics["new_lint_findings"] == 1
  assert t.breakdown == pytest.approx({"task": 0.0, "length": 0.0, "todo": -0.6, "malformed": -0.1, "repeat": -0.2,
                                       "no_message": -0.4, "lint": -0.5})
  assert t.reward == pytest.approx(-1.8)


def test_malformed_tool_call_tokens_become_an_error(tok, envs, tasks):
  call_open, call_close = (cf.special_id(tok, cf.TOOL_CALL), cf.special_id(tok, cf.TOOL_CALL_END))
  eot = cf.special_id(tok, cf.END_OF_TURN)
  finish = scripted.encode_assistant(tok, scripted.noop_policy(""))

  class Bad:
    def generate(self, requests):
      out = []
      for r in requests:
        n = tok.decode(list(r.prompt_ids), skip_special_tokens=False).count(cf.ASSISTANT)
        ids = [call_open] + tok.encode("{oops").ids + [call_close, eot] if n == 1 else finish
        out.append(GenerateResult(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), None, 0, "stop"))
      return out

  (t,) = harness.run_episodes(Bad(), tok, tasks[:1], envs, CFG)
  assert t.metrics["malformed_calls"] == 1 and t.metrics["turns"] == 2
  assert t.messages[3]["role"] == "tool" and "not valid JSON" in t.messages[3]["content"]


def test_self_summarization_chains_segments(tok, envs, tasks):
  hard = [t for t in tasks if t.metadata["level"] == 4]
  cfg = dataclasses.replace(CFG, context_budget=700, max_turn_tokens=160, observation_reserve=160, max_segments=6,
                            summary_max_tokens=80)
  trajs = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.oracle_policy(hard)), tok, hard, envs, cfg)
  for t in trajs:
    assert t.metrics["solved"] == 1.0, t.messages
    assert len(t.segments) >= 2
    for seg in t.segments[:-1]:
      assert seg.ends_with_summary and seg.turns[-1]["kind"] == "summary"
      assert cf.special_id(tok, cf.SUMMARY) in seg.tokens_T[seg.turns[-1]["start"] - 1:seg.turns[-1]["start"]]
      assert seg.gen_mask_T[seg.turns[-1]["start"]:seg.turns[-1]["gen_end"]].all()  # summaries are trained
    for seg, nxt in zip(t.segments, t.segments[1:], strict=False):
      summary_ids = seg.tokens_T[seg.turns[-1]["start"]:seg.turns[-1]["gen_end"] - 1]  # without <|end_of_turn|>
      prompt = nxt.tokens_T[:nxt.prompt_len]
      assert any((prompt[i:i + len(summary_ids)] == summary_ids).all() for i in range(len(prompt)))
      assert not nxt.gen_mask_T[:nxt.prompt_len].any()  # carried summary is prompt in the next segment
    assert all(len(s.tokens_T) <= cfg.context_budget for s in t.segments)
    rows = t.training_rows()
    assert [r["reward"] for r in rows] == [t.reward] * len(t.segments)
    # Solved; a chain that ran out of segments before `finish` ended without a message to the user.
    assert t.reward == pytest.approx(1.0 - cfg.rewards.no_message_weight * (t.stop_reason != "finish"))
  # The chain is bounded: with 2 segments allowed the hard tasks stop early, unsolved, still graded.
  short = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.oracle_policy(hard)), tok, hard, envs,
                               dataclasses.replace(cfg, max_segments=2))
  assert all(t.stop_reason == "max_segments" and len(t.segments) == 2 for t in short)
  assert all(t.metrics["solved"] == 0.0 and t.breakdown["task"] == 0.0 for t in short)


def test_prompt_too_long_is_a_clear_error(tok, envs, tasks):
  with pytest.raises(ValueError, match="leaves no room"):
    harness.run_episodes(scripted.ScriptedEngine(tok, scripted.noop_policy), tok, tasks[:1], envs,
                         harness.HarnessConfig(context_budget=200, max_turn_tokens=100, observation_reserve=50))


def test_oracle_and_noop_in_real_sandboxes(tok):
  """The same loop with the isolated `sandboxes` backend (bubblewrap namespaces, overlay forks)."""
  sandboxes = pytest.importorskip("sandboxes")
  from rollout.workspace import SandboxFactory
  try:
    factory = SandboxFactory()
  except sandboxes.BackendUnavailableError as e:
    pytest.skip(f"no namespaced sandboxes on this machine: {e}")
  try:
    envs = EnvironmentCache(factory)
    few = procedural.generate(3, seed=11, level=2)
    oracle = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.oracle_policy(few)), tok, few, envs, CFG)
    assert [t.metrics["solved"] for t in oracle] == [1.0] * 3
    noop = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.noop_policy), tok, few, envs, CFG)
    assert [t.metrics["solved"] for t in noop] == [0.0] * 3
  finally:
    factory.close()


def test_oracle_tells_apart_tasks_that_share_a_prompt(tok, envs):
  """Generated tasks can share a prompt (same names, different bug); the oracle tells them apart by what its reads
  showed, as a model must."""
  for level in (1, 2):
    pool = procedural.generate(1500, seed=5, level=level)
    by_prompt = {}
    for t in pool:
      by_prompt.setdefault(t.prompt, []).append(t)
    same = next(ts for ts in by_prompt.values() if len(ts) > 1)[:2]
    assert same[0].gold_patch != same[1].gold_patch
    trajs = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.oracle_policy(pool)), tok, same, envs, CFG)
    assert [t.metrics["solved"] for t in trajs] == [1.0, 1.0]


def test_abort_ends_the_episode(tok, envs, tasks):
  class Aborting:
    def generate(self, requests):
      return [GenerateResult(np.zeros(0, np.int32), np.zeros(0, np.float32), None, 0, "abort") for _ in requests]

  (t,) = harness.run_episodes(Aborting(), tok, tasks[:1], envs, CFG)
  assert t.stop_reason == "abort" and t.metrics["turns"] == 1 and t.metrics["solved"] == 0.0
  seg = t.segments[0]
  assert seg.tokens_T[-1] == cf.special_id(tok, cf.END_OF_TURN) and seg.gen_mask_T[-1] == 0  # closed by the loop


def test_segments_never_outgrow_the_context_budget(tok, envs, tasks):
  """A long last observation is cut where the segment would pass the budget (the engine's context, the trainer's
  row length); the transcript keeps it whole."""
  cfg = dataclasses.replace(CFG, context_budget=600, max_turn_tokens=128, observation_reserve=16, max_segments=1)
  call = {"name": "shell", "arguments": {"command": "python3 -c \"print('ab ' * 300)\""}}
  trajs = harness.run_episodes(scripted.ScriptedEngine(tok, lambda prompt: {"content": "", "tool_calls": [call]}),
                               tok, tasks, envs, cfg)
  for t in trajs:
    assert t.stop_reason == "max_segments" and len(t.segments) == 1
    assert len(t.segments[0].tokens_T) == cfg.context_budget
    assert "ab ab ab" in t.messages[-1]["content"]


class NeverStops:
  """Every turn runs to its max_tokens: an unclosed tool call (malformed), a summary cut at its cap."""

  def __init__(self, tok):
    self.opened = [cf.special_id(tok, cf.TOOL_CALL)] + tok.encode("ab").ids

  def generate(self, requests):
    sizes = [r.params.max_tokens for r in requests]
    return [GenerateResult(np.resize(self.opened, n).astype(np.int32), np.zeros(n, np.float32), None, 0, "length")
            for n in sizes]


def test_a_turn_cut_at_the_edge_of_the_budget_is_closed_inside_it(tok, envs, tasks):
  """A turn the engine cuts at max_tokens is closed by one more token (<|end_of_turn|>); a summary asked for after
  a cut observation has exactly summary_max_tokens of room, so without that token reserved a summary cut at its cap
  made a 497-token segment at context_budget=496 (the trainer's row length: the recipe run stopped at step 241)."""
  at_edge = 0
  for budget in range(360, 400):   # the prompt is ~220 tokens: from prompt + turn + reserve up
    cfg = dataclasses.replace(CFG, context_budget=budget, max_turn_tokens=64, observation_reserve=64,
                              summary_max_tokens=40, summary_prompt="Summarize.", max_segments=3, max_turns=6)
    for t in harness.run_episodes(NeverStops(tok), tok, tasks[:1], envs, cfg):
      assert all(len(s.tokens_T) <= budget for s in t.segments), (budget, [len(s.tokens_T) for s in t.segments])
      summaries = [s for s in t.segments if s.ends_with_summary]
      assert all(s.turns[-1]["gen_end"] - s.turns[-1]["start"] == cfg.summary_max_tokens for s in summaries)
      at_edge += any(len(s.tokens_T) == budget for s in summaries)
  assert at_edge   # some budgets put a cut summary exactly at the edge


def test_a_summary_request_that_cannot_fit_is_a_clear_error(tok, envs, tasks):
  """The default summary prompt (~100 tokens) and a 40-token summary do not fit in a 64-token observation_reserve:
  the error says so instead of writing a segment past context_budget."""
  cfg = dataclasses.replace(CFG, context_budget=380, max_turn_tokens=64, observation_reserve=64, summary_max_tokens=40,
                            max_segments=3)
  with pytest.raises(ValueError, match=r"summary request \(\d+ tokens\).*observation_reserve >= \d+"):
    harness.run_episodes(NeverStops(tok), tok, tasks[:1], envs, cfg)
