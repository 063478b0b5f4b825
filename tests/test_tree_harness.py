"""rollout/tree_harness.py: a group run as a tree — forked sandboxes equal a replay (on the unisolated local backend
and on bubblewrap's overlay forks), shared context, the worker."""
import dataclasses
import hashlib
import os

import numpy as np
import pytest

from composer_jax.rl import batch as rl_batch
from composer_jax.rl import setup
from rollout import chat_format as cf
from rollout import harness, tree_codec, tree_harness, workers
from rollout import tree as tree_lib
from rollout.engines import scripted
from rollout.engines.protocol import GenerateResult
from rollout.queue import QueueConsumer, QueueProducer
from rollout.rewards import RewardConfig
from rollout.staleness import StalenessConfig
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache, grade
from rollout.tools import ToolBox
from rollout.workspace import LocalFactory, SandboxFactory, SandboxWorkspace
from tests.test_tree_codec import assert_same

HCFG = harness.HarnessConfig(system_prompt=harness.SHORT_SYSTEM_PROMPT, context_budget=1024, max_turn_tokens=128,
                             observation_reserve=128, max_turns=4, max_segments=1,
                             rewards=RewardConfig(lint_weight=0.0), grade_workers=1,
                             grade_early=False)   # closed in order, once every episode has ended


def recording_factory(base, **kwargs):
  """A `base` factory whose workspaces record a digest of their files when closed (after grading), for the replay
  comparison."""
  class Recording(base):
    closed: list[dict[str, str]] = []

    def fork(self, snapshot):
      ws = super().fork(snapshot)
      ws.__class__ = RecordingWorkspace
      ws.factory = self
      return ws
  return Recording(**kwargs)


class RecordingWorkspace(SandboxWorkspace):
  def close(self):
    if not self.sb.closed:
      self.factory.closed.append(files(self))
    super().close()


def files(ws) -> dict[str, str]:
  """Every file's sha256 except what grading writes differently per run (its report, under a random name, which a
  workspace closed after grading keeps; caches)."""
  out = ws.run("find . -type f -not -path '*cache*' -not -name '*.xml' -not -path './.grade_*' "
               "-not -name 'composer_grade_report_*' | sort | xargs sha256sum").output
  return dict(line.split()[::-1] for line in out.splitlines())


class BranchingEngine:
  """Turn 0 writes a shared file; turn 1 writes a file named after the request's seed and appends to the shared
  one (so branches differ); turn 2 finishes. Episode 1 finishes at once (a leaf before the branch point)."""

  def __init__(self, tok):
    self.tok, self.requests = tok, []
    self.assistant = cf.special_id(tok, cf.ASSISTANT)

  def _message(self, req) -> dict:
    turn = list(req.prompt_ids).count(self.assistant) - 1
    seed = req.params.seed % 1000
    call = lambda name, **a: {"name": name, "arguments": a}  # noqa: E731
    if turn == 0 and "#1/" in req.request_id:
      return {"content": "", "tool_calls": [call("finish", message="gave up")]}
    if turn == 0:
      return {"content": "", "tool_calls": [call("write_file", path="notes/shared.txt", content="trunk\n")]}
    if turn == 1:
      return {"content": "", "tool_calls": [call("shell", command=f"echo {seed} >> notes/shared.txt"),
                                            call("write_file", path=f"notes/b{seed}.txt", content=str(seed))]}
    return {"content": "", "tool_calls": [call("finish", message="done")]}

  def generate(self, requests):
    self.requests += requests
    out = []
    for req in requests:
      ids = scripted.encode_assistant(self.tok, self._message(req))
      out.append(GenerateResult(np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), None, 0, "stop"))
    return out


@pytest.fixture(scope="module", params=["local", "bwrap"])
def setting(request, tmp_path_factory):
  if request.param == "bwrap" and os.geteuid() != 0:
    pytest.skip("the bwrap backend needs root (overlay mounts)")
  pool = procedural.generate(2, seed=3, level=1)
  tok = setup.fit_tokenizer(pool, harness.SHORT_SYSTEM_PROMPT, 512)
  factory = recording_factory(LocalFactory, root=str(tmp_path_factory.mktemp("ws"))) if request.param == "local" \
    else recording_factory(SandboxFactory, backend="bwrap")
  envs = EnvironmentCache(factory)
  yield pool, tok, envs
  envs.factory.close()


def replay(envs, task, traj) -> dict[str, str]:
  """A fresh workspace running the leaf's tool calls from the start, graded the same way."""
  ws = envs.fork(task)
  try:
    tools = ToolBox(ws, HCFG.tools)
    for m in traj.messages:
      for c in m.get("tool_calls") or []:
        tools.call(cf.ToolCall(c["name"], c["arguments"]))
    grade(ws, task.tests)
    return files(ws)
  finally:
    ws.sb.close()   # not through RecordingWorkspace.close: not one of the rollout's


def test_a_leaf_graded_while_its_siblings_branch_is_the_same_tree(setting):
  """Episode 1 ends at its first turn: with `grade_early` it is graded in the background while episode 0 is forked
  (snapshot, forks) and goes on. The trajectories, their tree places and every leaf's final files are those of
  grading only after the last step."""
  pool, tok, envs = setting
  tcfg = tree_harness.TreeConfig(branch_turns=(0, 1), fanouts=(2, 2))
  runs = {}
  for early in (False, True):
    envs.factory.closed.clear()
    cfg = dataclasses.replace(HCFG, grade_workers=4, grade_early=early)
    trajs = tree_harness.rollout_tree(BranchingEngine(tok), tok, pool[0], envs, cfg, tcfg)
    runs[early] = ([(t.reward, t.messages, t.tree, [s.tokens_T.tolist() for s in t.segments]) for t in trajs],
                   sorted(map(sorted, (d.items() for d in envs.factory.closed))))
  assert runs[True] == runs[False]
  assert [t[2]["path"] for t in runs[True][0]] == [[0, 0], [1], [0, 1]]


def test_tree_group_forks_state_and_shares_the_context(setting):
  pool, tok, envs = setting
  task = pool[0]
  engine = BranchingEngine(tok)
  envs.factory.closed.clear()
  tcfg = tree_harness.TreeConfig(branch_turns=(0, 1), fanouts=(2, 2))
  trajs = tree_harness.rollout_tree(engine, tok, task, envs, HCFG, tcfg)
  # Episode 0 forked after its first turn into itself and episode 2; episode 1 finished first: it stands for 2.
  assert [t.tree["path"] for t in trajs] == [[0, 0], [1], [0, 1]]
  assert [t.tree["multiplicity"] for t in trajs] == [1, 2, 1]
  branch_at = trajs[0].tree["starts"][1]
  assert trajs[2].tree["starts"][1] == branch_at and branch_at[0] == 0
  tree = tree_lib.build([t.to_dict() for t in trajs])     # validates the shared tokens of every node
  assert tree.size == tcfg.size == 4
  # The branches' first requests are the shared context itself: a prefix-caching engine continues both from it.
  after = [r for r in engine.requests if len(r.prompt_ids) == branch_at[1]]
  assert len(after) == 2 and after[0].prompt_ids == after[1].prompt_ids
  np.testing.assert_array_equal(after[0].prompt_ids, trajs[0].segments[0].tokens_T[:branch_at[1]])
  assert after[0].params.seed != after[1].params.seed
  # Each leaf's sandbox (forked at the branch point, not replayed) ends with the files a replay of its calls makes.
  assert len(envs.factory.closed) == 3
  for traj, got in zip(trajs, envs.factory.closed[-3:], strict=True):
    assert got == replay(envs, task, traj), traj.tree
  shared = {k for k in envs.factory.closed[0] if "notes/" in k}
  assert len(shared) == 2 and shared != {k for k in envs.factory.closed[2] if "notes/" in k}  # branches differ
  # The trunk's tokens were generated once for two leaves.
  unique = sum(int(s.gen_mask_T.sum()) for s in trajs[0].segments) + \
    int(trajs[2].segments[0].gen_mask_T[branch_at[1]:].sum()) + trajs[1].n_generated
  assert unique < sum(t.n_generated for t in trajs)
  b = rl_batch.make_batch([[t.to_dict() for t in trajs]], rl_batch.BatchConfig(rows=4, length=1024, n_moe_layers=0,
                                                                                top_k=1))
  assert b["gen_mask"].sum() == unique
  # Weighted, the loss sees every leaf's tokens: leaf 1 stands for two leaves.
  assert (b["gen_mask"] * b["loss_weight"]).sum() == trajs[0].n_generated + 2 * trajs[1].n_generated + \
    trajs[2].n_generated


def test_worker_appends_tree_groups(setting, tmp_path):
  pool, tok, envs = setting
  tcfg = tree_harness.TreeConfig(branch_turns=(1,), fanouts=(3,))
  with pytest.raises(ValueError, match="give 3 leaves per group, but samples_per_prompt=4"):
    workers.WorkerConfig(samples_per_prompt=4, tree=tcfg)
  cfg = workers.WorkerConfig(samples_per_prompt=3, max_groups=1, tree=tcfg)
  url = f"file://{tmp_path}/q"
  engine = BranchingEngine(tok)
  assert workers.run_worker(engine, tok, pool, envs, HCFG, QueueProducer(url, "worker0"), cfg,
                            str(tmp_path / "w.json")) == 1
  (group,) = QueueConsumer(url, StalenessConfig(max_staleness=4)).poll(0)
  trajs = group.trajectories()
  # A trunk of one turn (the root's only child), then three branches.
  assert [t["tree"]["path"] for t in trajs] == [[0, 0], [0, 1], [0, 2]]
  assert group.key.n_rows == 3
  t = tree_lib.build(trajs)
  assert t.nodes[(0,)].advantage == 0.0 and t.nodes[(0,)].count == 3
  digest = {hashlib.sha256(np.asarray(x["segments"][0]["tokens_T"]).tobytes()).hexdigest() for x in trajs}
  assert len(digest) == 3


def test_a_branch_that_does_not_start_fails_the_group_whole(setting, monkeypatch):
  """A fork at a branch point that fails is a SandboxStartError (the worker retries or drops the group whole)."""
  pool, tok, envs = setting
  real, calls = envs.factory.fork, []

  def flaky(snapshot):
    calls.append(snapshot)
    if len(calls) > 2:          # the two episodes from the prompt start; the first branch does not
      raise OSError("overlay mount failed")
    return real(snapshot)
  monkeypatch.setattr(envs.factory, "fork", flaky)
  with pytest.raises(harness.SandboxStartError, match="a branch of episode 0 did not start: OSError"):
    tree_harness.rollout_tree(BranchingEngine(tok), tok, pool[0], envs, HCFG,
                              tree_harness.TreeConfig(branch_turns=(0, 1), fanouts=(2, 2)))
  assert len(calls) == 3


class SummarizingEngine(BranchingEngine):
  """BranchingEngine that also answers summary requests (with the request's seed, so branches' summaries differ)."""

  def _message(self, req) -> dict:
    if req.prompt_ids[-1] == cf.special_id(self.tok, cf.SUMMARY):
      return {"content": f"wrote the notes, seed {req.params.seed % 1000}"}
    return super()._message(req)


def test_branches_that_cross_a_summary_boundary(setting):
  """A context this small asks for a summary right at the branch point: each branch writes its own summary and
  continues in new segments; credit, storage and the sandbox state hold across the boundary."""
  pool, tok, envs = setting
  hcfg = dataclasses.replace(HCFG, context_budget=256, max_turn_tokens=64, observation_reserve=96,
                             summary_max_tokens=32, max_segments=3, max_turns=6)
  envs.factory.closed.clear()
  trajs = tree_harness.rollout_tree(SummarizingEngine(tok), tok, pool[0], envs, hcfg,
                                    tree_harness.TreeConfig(branch_turns=(0, 1), fanouts=(2, 2)))
  leaves = [t.to_dict() for t in trajs]
  (s, o) = trajs[0].tree["starts"][1]
  assert trajs[2].tree["starts"][1] == [s, o] and s == 0
  for t in (trajs[0], trajs[2]):
    assert len(t.segments) == 3 and t.segments[0].ends_with_summary
    summary = t.segments[0].gen_mask_T[o:]
    assert summary.all() and len(summary) > 1                  # the summary was generated after the branch point
  assert not np.array_equal(trajs[0].segments[0].tokens_T, trajs[2].segments[0].tokens_T)
  credit = tree_lib.token_credit(leaves)
  tree = tree_lib.build(leaves)
  for i in (0, 2):   # each branch trains its own summary with its own node's advantage, the trunk once (leaf 0)
    np.testing.assert_array_equal(credit[i][0]["train_T"][o:], 1)
    np.testing.assert_array_equal(credit[i][0]["advantage_T"][o:], tree.nodes[tuple(trajs[i].tree["path"])].advantage)
    assert credit[i][0]["train_T"][:o].any() == (i == 0)
  stored = tree_codec.share_prefixes(leaves)
  assert stored[2]["shared_prefix"]["until"] == [0, o]
  assert_same(tree_codec.restore_prefixes(stored), leaves)
  for traj, got in zip(trajs, envs.factory.closed[-3:], strict=True):
    assert got == replay(envs, pool[0], traj), traj.tree


class UncertainEngine(BranchingEngine):
  """Writes a file in each of its first three turns, then finishes. Its greedy probes meet a token of entropy
  2 nats at episode 0's second turn start, and 0.2 nats everywhere else."""

  def _turn(self, req) -> int:
    return list(req.prompt_ids).count(self.assistant) - 1

  def _message(self, req) -> dict:
    if self._turn(req) < 3:
      return {"content": "", "tool_calls": [{"name": "write_file", "arguments": {
          "path": f"notes/t{self._turn(req)}_{req.params.seed % 1000}.txt", "content": "x"}}]}
    return {"content": "", "tool_calls": [{"name": "finish", "arguments": {"message": "done"}}]}

  def generate(self, requests):
    out = []
    for req, res in zip(requests, super().generate(requests), strict=True):
      ent = np.full(len(res.output_ids), 0.2, np.float32)
      if req.request_id.endswith("/probe") and "#0/" in req.request_id and self._turn(req) == 2:
        ent[-1] = 2.0
      out.append(dataclasses.replace(res, entropies=ent))
    return out


def test_entropy_branch_points_come_before_the_deadline_where_the_probe_is_uncertain(setting):
  """branch_turns=(0, 3) with branch_entropy: episode 0 branches at its second turn start (its probe met 2 nats),
  episode 1 at the deadline, after its third turn. Probes are greedy, short, and continue the branch point's
  context; the branches' sandboxes hold the files of their own calls."""
  pool, tok, envs = setting
  engine = UncertainEngine(tok)
  envs.factory.closed.clear()
  tcfg = tree_harness.TreeConfig(branch_turns=(0, 3), fanouts=(2, 2), branch_entropy=1.0, probe_tokens=5)
  trajs = tree_harness.rollout_tree(engine, tok, pool[0], envs, HCFG, tcfg)
  assert [t.tree["path"] for t in trajs] == [[0, 0], [1, 0], [0, 1], [1, 1]]
  tree = tree_lib.build([t.to_dict() for t in trajs])     # validates the shared tokens of every node
  assert tree.size == 4
  turns_before = [list(t.segments[0].tokens_T[:t.tree["starts"][1][1]]).count(engine.assistant) - 1 for t in trajs]
  assert turns_before == [2, 3, 2, 3]
  probes = [r for r in engine.requests if r.request_id.endswith("/probe")]
  # Turn starts 1 and 2 of both episodes are probed (a start at the deadline is not); none after a branch.
  assert sorted(engine._turn(r) for r in probes) == [1, 1, 2, 2]
  assert all(r.params.top_k == 1 and r.params.max_tokens == 5 for r in probes)
  branch_at = trajs[0].tree["starts"][1][1]
  assert any(r.prompt_ids == tuple(trajs[0].segments[0].tokens_T[:branch_at]) for r in probes)
  for traj, got in zip(trajs, envs.factory.closed[-4:], strict=True):
    assert got == replay(envs, pool[0], traj), traj.tree


def test_entropy_branch_points_need_an_engine_that_reports_entropies(setting):
  pool, tok, envs = setting
  with pytest.raises(ValueError, match="the engine reports no entropies"):
    tree_harness.rollout_tree(BranchingEngine(tok), tok, pool[0], envs, HCFG,
                              tree_harness.TreeConfig(branch_turns=(0, 3), fanouts=(2, 2), branch_entropy=1.0))
  with pytest.raises(ValueError, match="branch_entropy must be > 0"):
    tree_harness.TreeConfig(branch_turns=(0, 3), fanouts=(2, 2), branch_entropy=0.0)


def test_a_threshold_never_met_branches_at_the_deadlines_as_by_turn(setting):
  """Probes that never meet the threshold change nothing: the same tree, tokens and files as branching by turn."""
  pool, tok, envs = setting
  by_turn = tree_harness.TreeConfig(branch_turns=(0, 3), fanouts=(2, 2))
  runs = []
  for tcfg in (by_turn, dataclasses.replace(by_turn, branch_entropy=5.0)):
    envs.factory.closed.clear()
    trajs = tree_harness.rollout_tree(UncertainEngine(tok), tok, pool[0], envs, HCFG, tcfg)
    runs.append((trajs, list(envs.factory.closed)))
  (turn_trajs, turn_files), (ent_trajs, ent_files) = runs
  assert [t.tree for t in ent_trajs] == [t.tree for t in turn_trajs]
  for a, b in zip(ent_trajs, turn_trajs, strict=True):
    np.testing.assert_array_equal(a.segments[0].tokens_T, b.segments[0].tokens_T)
  assert ent_files == turn_files
