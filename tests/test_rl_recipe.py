"""rl.py:recipe: self-summary chains through the harness into the RL batch, the reward terms in the batch against
hand-computed values, and SFT demonstrations that are the segments RL trains on."""

import dataclasses
import os
import random
import re

import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import configs
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import losses, setup
from composer_jax.rl.config import RunConfig
from experiments.configs import common
from experiments.configs import rl as rl_configs
from rollout import chat_format as cf
from rollout import harness, rewards
from rollout.engines import scripted
from rollout.rewards import RewardConfig
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import LocalFactory


@pytest.fixture(scope="module")
def recipe():
  return configs.from_dict(RunConfig, rl_configs.get_config("recipe"), workdir="/tmp/unused")


@pytest.fixture(scope="module")
def tok(recipe):
  # The run's kind of tokenizer: a 512-token BPE fitted to training tasks of the mix.
  pool = [t for lv in (1, 2, 3) for t in procedural.generate(60, seed=1, split="train", level=lv)]
  return setup.fit_tokenizer(pool, recipe.harness.system_prompt, recipe.tokenizer)


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
  return EnvironmentCache(LocalFactory(root=str(tmp_path_factory.mktemp("ws"))))


@pytest.fixture(scope="module")
def chains(recipe, tok, envs):
  """Oracle episodes of every level under the recipe's harness (level -> trajectories, tasks)."""
  out = {}
  for lv in (1, 2, 3):
    tasks = procedural.generate(6, seed=5, split="heldout", level=lv)
    engine = scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks))
    out[lv] = (harness.run_episodes(engine, tok, tasks, envs, recipe.harness), tasks)
  return out


def test_recipe_config_and_its_sweep_rows_build():
  c = configs.from_dict(RunConfig, rl_configs.get_config("recipe"), workdir="/tmp/x")
  assert c.tasks.levels == (1, 2, 3) and c.harness.max_segments >= 2 and c.harness.rewards.length_weight > 0
  assert c.harness.rewards.penalty_cap and c.harness.rewards.todo_weight and c.harness.rewards.malformed_weight
  rows = rl_configs.get_sweep("recipe")
  assert rl_configs.get_sweep() == rows   # the default run's measurement rows
  assert {"seed": 1} in rows and {"harness.rewards.length_weight": 0.0} in rows
  assert {r.get("harness.rewards.length_q") for r in rows} >= {0.0, 1.0}
  # The default comparison rows at their best KL β: two seeds, 500 held-out tasks per level of the three.
  assert all({**rl_configs.NEARMISS_CURRICULUM_KL, "seed": s} in rows for s in (0, 1))
  assert rl_configs.NEARMISS_CURRICULUM_KL["eval.tasks"] == 500 * len(c.tasks.levels)
  # the KL βs 1e-3, 1e-2, 5e-2, and 5e-2 from the longer start
  seed_rows = [r for r in rows if "seed" in r and r.get("sft.demo_accuracy") == 0.5]
  assert len(seed_rows) == 8 and all(r["eval.tasks"] == 500 * len(c.tasks.levels) for r in seed_rows)
  for overrides in rows:
    run = configs.from_dict(RunConfig, common.override(rl_configs.get_config("recipe"), overrides), workdir="/tmp/x")
    assert run.tasks.seed == run.seed + 1   # a seed row reseeds the task stream too
  # λ(q) makes an oracle-length level-3 episode pay the same at every q: C differs in shape, not scale.
  for q in (0.0, 0.5, 1.0):
    k, x = c.harness.rewards.length_k, rl_configs.LEVEL3_TOKENS
    c_x = x if q == 0 else (np.log1p(k * x) / k if q == 1 else ((1 + k * x) ** (1 - q) - 1) / (k * (1 - q)))
    assert rl_configs._length_weight(q) * c_x == pytest.approx(rl_configs.LEVEL3_COST)


def test_the_longer_start_rows_change_only_the_sft_steps():
  kl_row = common.override(rl_configs.get_config("recipe"), rl_configs.NEARMISS_CURRICULUM_KL)
  longer = common.override(rl_configs.get_config("recipe"), rl_configs.LONG_START)
  assert longer.sft.steps == 2 * kl_row.sft.steps
  longer.sft.steps = kl_row.sft.steps
  assert longer.to_dict() == kl_row.to_dict()
  assert all({**rl_configs.LONG_START, "seed": s} in rl_configs.get_sweep() for s in (0, 1))


def test_the_default_run_is_recipe_best_the_best_measured_row():
  """The default (`make run`, `rl_main.py` with no --config) is `rl.py:recipe_best` = recipe + LONG_START (the
  rows measured on both seeds): levels 1-3, summary chains, C(x) and the behavioural terms on, the start's second
  stage 3600 steps; `seed=` and `steps=` still apply."""
  default = configs.from_dict(RunConfig, rl_configs.get_config(), workdir="/tmp/x")
  assert default == configs.from_dict(RunConfig, rl_configs.get_config("recipe_best"), workdir="/tmp/x")
  assert default.tasks.levels == (1, 2, 3) and default.harness.max_segments >= 2
  assert default.harness.rewards.length_weight > 0 and default.harness.rewards.todo_weight > 0
  assert default.harness.rewards.malformed_weight > 0 and default.eval.control and default.eval.drop_oldest
  for seed in (0, 1):
    best = rl_configs.get_config(f"recipe_best,seed={seed}")
    row = common.override(rl_configs.get_config(f"recipe,seed={seed}"), rl_configs.LONG_START)
    assert best.to_dict() == row.to_dict()
    run = configs.from_dict(RunConfig, best, workdir="/tmp/x")
    assert (run.seed, run.tasks.seed, run.rl.loss.kl_coef, run.rl.steps) == (seed, seed + 1, 5e-2, 300)
    assert run.sft.curriculum_levels == (1,) and run.sft.demo_accuracy == 0.5 and run.eval.tasks == 1500
    assert (run.sft.curriculum_steps, run.sft.steps) == (900, 3600)
  assert rl_configs.get_config("recipe_best,steps=7").rl.steps == 7
  with pytest.raises(ValueError, match="recipe_best is a row of get_sweep"):
    rl_configs.get_sweep("recipe_best")   # recipe's rows override rl.py:recipe, not this row
  with open(os.path.join(os.path.dirname(__file__), "..", "Makefile")) as f:
    make = f.read()
  # `make run` runs rl_main's default config; `make colab` the level-1 run.
  assert "run: $(STAMP)\n\t$(BIN)/python experiments/rl_main.py --workdir=runs/rl\n" in make
  assert "rl.py:colab --workdir=runs/rl_colab" in make


def test_a_sweep_row_with_a_typo_is_an_error_naming_it():
  c = rl_configs.get_config("recipe")
  with pytest.raises(KeyError, match="'rl.loss.kl_cof'"):
    common.override(c, {"rl.loss.kl_cof": 0.1})
  with pytest.raises(KeyError, match="the config has no 'rl.los'"):
    common.override(c, {"rl.los.kl_coef": 0.1})
  assert c.rl.loss.kl_coef == 1e-3   # nothing was set


def test_the_level1_run_has_the_length_penalty_and_behavioural_terms_on():
  """`make colab`'s rewards are the recipe's: C(x) at q = 0.5, the behavioural terms and the cap (by hand:
  λ = 0.1 / C(321), C(x) = ((1 + 0.01 x)^0.5 - 1) / 0.005; a solved 87-token level-1 episode pays 0.035)."""
  colab = configs.from_dict(RunConfig, rl_configs.get_config("colab"), workdir="/tmp/x").harness.rewards
  recipe = configs.from_dict(RunConfig, rl_configs.get_config("recipe"), workdir="/tmp/x").harness.rewards
  # The recipe charges the effort terms to solved episodes only (rollout/rewards.py); the rest is the same.
  assert colab.effort_scope == "all" and recipe.effort_scope == "solved"
  assert colab == dataclasses.replace(recipe, effort_scope="all")
  assert colab.penalty_cap == 0.5 and colab.todo_weight > 0 and colab.malformed_weight > 0
  lam = 0.1 / ((4.21 ** 0.5 - 1) / 0.005)
  assert colab.length_weight == pytest.approx(lam)
  total, terms = rewards.compute_reward(1.0, rewards.EpisodeStats(output_tokens=87, finished=True,
                                                                   final_message="Fixed."), colab)
  assert terms["length"] == pytest.approx(-lam * (1.87 ** 0.5 - 1) / 0.005) and -terms["length"] == pytest.approx(
      0.0349, abs=1e-4)
  assert total == pytest.approx(1.0 + terms["length"])


def test_level3_needs_a_summary_chain_levels_1_2_do_not(chains, recipe):
  for lv, (trajs, _) in chains.items():
    assert all(t.metrics["solved"] == 1.0 and t.stop_reason == "finish" for t in trajs), lv
    n_seg = [len(t.segments) for t in trajs]
    if lv == 3:
      assert all(2 <= n <= recipe.harness.max_segments for n in n_seg), n_seg
    else:
      assert n_seg == [1] * len(trajs), (lv, n_seg)
    for t in trajs:
      assert all(len(s.tokens_T) <= recipe.harness.context_budget for s in t.segments)
      # No turn and no summary is cut by a budget (the reserve holds a tool result + request + summary).
      assert all(tr["finish_reason"] == "stop" for s in t.segments for tr in s.turns)


def test_summaries_carry_what_the_next_segment_needs(chains):
  """After a summary the oracle continues from it alone: a planned edit in the summary is the next segment's
  edit, a file it names is the next read, a fixed function is not touched again."""
  trajs, _ = chains[3]
  checked = 0
  for t in trajs:
    segs = harness.segment_transcripts(t.messages)
    for seg in segs[1:]:
      summary = seg[2]
      assert summary["role"] == "summary" and summary["train"] is False
      first = next(m for m in seg[3:] if m["role"] == "assistant")["tool_calls"][0]
      plan = re.search(r"`([\w.]+)`: `(.+?)` -> `(.+?)`", summary["content"])
      if plan:
        path, old, new = plan.groups()
        assert first["name"] == "edit" and first["arguments"]["path"] == path
        assert old in first["arguments"]["old"] and new in first["arguments"]["new"]
        checked += 1
      for name, path in re.findall(r"(\w+) is in `([\w.]+)`\.", summary["content"])[:1]:
        assert first == {"name": "read_file", "arguments": {"path": path}}, (name, first)
        checked += 1
      left = re.findall(r"Left: (\w+)\.", summary["content"])
      if left and not plan and " is in " not in summary["content"]:   # next: find where it lives
        assert first == {"name": "grep", "arguments": {"pattern": f"def {left[0]}"}}
        checked += 1
      fixed = re.findall(r"Fixed (\w+)\.", summary["content"])
      later = " ".join(str(m.get("tool_calls")) for m in seg[3:])
      assert not any(f"def {name}" in later for name in fixed)
  assert checked >= 1


def test_chain_segments_become_rows_that_share_the_episodes_advantage(chains, tok, recipe):
  """A multi-segment trajectory: one row per segment, every row with the trajectory's reward; the summary tokens
  are trained (gen_mask) with that advantage; the next row starts from system + task + summary."""
  trajs, tasks = chains[3]
  a = trajs[0]
  worse = dataclasses.replace(a, reward=a.reward - 1.0)   # a group of two: the same chain, one scored lower
  group = [a.to_dict(), worse.to_dict()]
  n_rows = 2 * len(a.segments)
  cfg = rl_batch.BatchConfig(rows=n_rows + 1, length=recipe.harness.context_budget, n_moe_layers=0, top_k=1)
  b = rl_batch.make_batch([group], cfg)
  assert b["valid"].tolist() == [1.0] * n_rows + [0.0]
  assert b["first"][:n_rows].tolist() == ([1.0] + [0.0] * (len(a.segments) - 1)) * 2
  adv = np.asarray(losses.group_advantages(jnp.asarray(b["reward"]), jnp.asarray(b["group"]),
                                           jnp.asarray(b["first"]), jnp.asarray(b["valid"])))
  S = len(a.segments)
  np.testing.assert_allclose(adv[:S], 0.5, atol=1e-6)          # r - mean over the 2 trajectories, not 2S rows
  np.testing.assert_allclose(adv[S:n_rows], -0.5, atol=1e-6)
  summary_id = cf.special_id(tok, cf.SUMMARY)
  for i, seg in enumerate(a.segments):
    row = b["tokens"][i, :len(seg.tokens_T)]
    np.testing.assert_array_equal(row, seg.tokens_T)
    if seg.ends_with_summary:
      turn = seg.turns[-1]
      assert turn["kind"] == "summary" and b["tokens"][i, turn["start"] - 1] == summary_id
      assert b["gen_mask"][i, turn["start"]:turn["gen_end"]].all()   # trained, with the row's advantage adv[i]
      # The next row starts from system + task + this summary (as prompt), then the generation prompt.
      text = tok.decode(seg.tokens_T[turn["start"]:turn["gen_end"] - 1].tolist(), skip_special_tokens=False)
      head = harness.segment_head(recipe.harness.system_prompt, tasks[0].prompt, text)
      ids, _ = cf.encode_messages(tok, head, add_generation_prompt=True)
      nxt = a.segments[i + 1]
      np.testing.assert_array_equal(b["tokens"][i + 1, :len(ids)], ids)
      assert nxt.prompt_len == len(ids) and not b["gen_mask"][i + 1, :len(ids)].any()
  assert b["traj_gen_tokens"][0] == a.metrics["output_tokens"] == sum(s.n_generated for s in a.segments)


def test_reward_terms_in_the_batch_against_hand_computed_values(recipe, tok, envs):
  """Length penalty and behavioural terms of a scripted episode, as the RL batch carries them."""
  task = procedural.generate(1, seed=9, split="train", level=3)[0]
  oracle = task.metadata["oracle"]
  todo, *rest, finish = oracle
  # The todo list, a malformed call, a repeated read, then the fixes; it finishes with one item still open and an
  # empty message.
  read = next(t for t in rest if t["tool_calls"][0]["name"] == "read_file")
  script = [todo, {"content": "", "tool_calls": [{"name": "explode", "arguments": {}}]}, read, *rest]
  script = [dict(t, tool_calls=[c for c in t["tool_calls"] if not (c["name"] == "todo" and "done" in c["arguments"]
                                                                  and c["arguments"]["done"] == [2])])
            for t in script]
  script.append({"content": "", "tool_calls": [{"name": "finish", "arguments": {"message": ""}}]})

  def policy(text):
    return script[text.count(cf.ASSISTANT) - 1]

  hcfg = dataclasses.replace(recipe.harness, max_segments=1, context_budget=1024, max_turn_tokens=64,
                             observation_reserve=64, max_turns=len(script))
  (t,) = harness.run_episodes(scripted.ScriptedEngine(tok, policy), tok, [task], envs, hcfg)
  assert t.metrics["solved"] == 1.0 and t.stop_reason == "finish"
  b = rl_batch.make_batch([[t.to_dict()]], rl_batch.BatchConfig(rows=1, length=1024, n_moe_layers=0, top_k=1))
  x = float(b["traj_gen_tokens"][0])
  assert x == float(b["gen_mask"][0].sum()) and x > 100
  w: RewardConfig = recipe.harness.rewards
  # C(x) at q = 0.5, k = 0.01 by hand: ((1 + 0.01 x)^0.5 - 1) / 0.005.
  length = w.length_weight * ((1 + 0.01 * x) ** 0.5 - 1) / 0.005
  # read_file of the same path twice: 1 repeat; 'explode': 1 malformed; 1 todo left open; no final message.
  want = 1.0 - length - 0.05 * 1 - 0.02 * 1 - 0.05 * 1 - 0.05
  assert t.metrics["malformed_calls"] == 1 and t.metrics["repeated_calls"] == 1
  assert b["reward"][0] == pytest.approx(want, abs=1e-6) and b["passed"][0] == 1.0
  assert t.breakdown["length"] == pytest.approx(-length) and t.breakdown["todo"] == pytest.approx(-0.05)


def test_sft_demonstrations_are_the_segments_rl_trains_on(chains, tok):
  """Each per-segment transcript encodes to its segment's tokens, trained exactly where the model generated."""
  trajs, _ = chains[3]
  for t in trajs:
    segs = harness.segment_transcripts(t.messages)
    assert len(segs) == len(t.segments)
    for transcript, seg in zip(segs, t.segments, strict=True):
      ids, mask = cf.encode_messages(tok, transcript)
      T = len(seg.tokens_T)
      np.testing.assert_array_equal(ids[:T], seg.tokens_T)   # the last segment's transcript has finish's result too
      np.testing.assert_array_equal(np.asarray(mask[:T]), seg.gen_mask_T)
  one = chains[1][0][0]
  assert harness.segment_transcripts(one.messages) == [one.messages]   # one segment: unchanged


def test_oracle_summaries_cover_every_step_and_near_misses_plan_their_wrong_edit():
  task = procedural.generate(1, seed=3, split="train", level=3)[0]
  summaries = task.metadata["oracle_summaries"]
  assert len(summaries) == len(task.metadata["oracle"]) + 1
  assert [int(re.match(r"completed steps: (\d+)\.", s).group(1)) for s in summaries] == list(range(len(summaries)))
  # Level 3's oracle: todo, then per fix grep, read, edit (+ todo done); then finish. What each summary knows:
  turns = task.metadata["oracle"]
  name, path = turns[1]["tool_calls"][0]["arguments"]["pattern"][4:], turns[2]["tool_calls"][0]["arguments"]["path"]
  edit = turns[3]["tool_calls"][0]["arguments"]
  assert f"Left: {name}." in summaries[1]                                     # not found yet
  assert f"{name} is in `{path}`." in summaries[2]                            # the grep's answer
  assert f"`{path}`: `{edit['old'].strip()}` -> `{edit['new'].strip()}`." in summaries[3]   # the read's plan
  assert f"Fixed {name}." in summaries[4] and f"Fixed {name}." in summaries[-1]
  miss = procedural.near_miss(task, random.Random(0))
  edits = [c["arguments"]["new"] for t in miss.metadata["oracle"] for c in t["tool_calls"] if c["name"] == "edit"]
  plans = [m for s in miss.metadata["oracle_summaries"] for m in re.findall(r"-> `(return .+?)`", s)]
  assert set(plans) <= {e.strip().splitlines()[-1].strip() for e in edits}


def test_success_rate_reports_each_level_and_tokens_per_solved_task(tmp_path, tok, envs, recipe):
  """results.json's per-level figures: solve rate with its Wilson CI and mean generated tokens per solved task."""
  import json

  from composer_jax.rl import evaluate
  l1 = procedural.generate(3, seed=8, split="heldout", level=1)
  l2 = procedural.generate(2, seed=8, split="heldout", level=2)
  tasks = [l1[0], l2[0], l1[1], l2[1], l1[2]]
  only_l1 = scripted.ScriptedEngine(tok, scripted.oracle_policy(l1))   # cannot do level 2: answers in plain text
  got = evaluate.success_rate(only_l1, tok, tasks, envs, recipe.harness, 1.0, str(tmp_path / "e"))
  recs = [json.loads(line) for line in open(tmp_path / "e" / "results.jsonl")]
  tokens = {r["task_id"]: r["samples"][0]["output_tokens"] for r in recs}
  want_l1 = sum(tokens[t.id] for t in l1) / 3
  assert got["success"] == pytest.approx(3 / 5) and got["n"] == 5
  assert got["tokens_per_solved"] == pytest.approx(want_l1)      # unsolved episodes do not count
  lo, hi = evaluate.wilson(3, 3)
  assert got["levels"]["1"] == {"success": 1.0, "ci_low": lo, "ci_high": hi, "n": 3, "tokens_per_solved": want_l1}
  lo, hi = evaluate.wilson(0, 2)
  assert got["levels"]["2"] == {"success": 0.0, "ci_low": lo, "ci_high": hi, "n": 2, "tokens_per_solved": None}
  json.dumps(got)   # goes into results.json as it is


def test_trainer_logs_each_reward_term_per_step():
  from composer_jax.rl import trainer
  trajs = [{"breakdown": {"task": 1.0, "length": -0.1, "todo": 0.0}}, {"breakdown": {"task": 0.0, "length": -0.3,
                                                                                    "todo": -0.05}}]
  assert trainer.reward_terms(trajs) == pytest.approx({"reward/task": 0.5, "reward/length": -0.2,
                                                       "reward/todo": -0.025})
  assert trainer.reward_terms([{}]) == {}


def test_summaries_from_another_policy_decide_the_chain(recipe, tok, envs):
  """SummariesFrom: action turns from the actor, summaries from the summarizer, results in request order. With the
  oracle acting, its own summaries finish level 3; a summarizer that forgets the progress makes it start over and
  run out of turns or segments (so the measurement can see a summary's worth at equal context budget)."""
  from rollout.engines.split import SummariesFrom
  tasks = procedural.generate(3, seed=4, split="heldout", level=3)
  oracle = scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks))
  forgetful = scripted.ScriptedEngine(tok, lambda text: {"content": "completed steps: 0. Working on it."})
  summary_id = cf.special_id(tok, cf.SUMMARY)
  good = harness.run_episodes(SummariesFrom(oracle, oracle, summary_id), tok, tasks, envs, recipe.harness)
  bad = harness.run_episodes(SummariesFrom(oracle, forgetful, summary_id), tok, tasks, envs, recipe.harness)
  assert all(t.metrics["solved"] == 1.0 and len(t.segments) >= 2 for t in good)
  assert all(t.stop_reason in ("max_segments", "max_turns") and t.metrics["solved"] == 0.0 for t in bad)
  assert all(m["content"] == "completed steps: 0. Working on it." for t in bad for m in t.messages
             if m["role"] == "summary")

  class Recorder:
    def __init__(self, inner):
      self.inner, self.seen = inner, []

    def generate(self, reqs):
      self.seen += [r.request_id for r in reqs]
      return self.inner.generate(reqs)

  act, summ = Recorder(oracle), Recorder(forgetful)
  harness.run_episodes(SummariesFrom(act, summ, summary_id), tok, tasks[:1], envs, recipe.harness)
  assert summ.seen and not set(act.seen) & set(summ.seen)


def test_drop_oldest_overflow_continues_from_the_most_recent_turns(recipe, tok, envs):
  """The no-summary ablation: at a full context the next segment starts from system + task + the most recent whole
  turns that fit (all prompt), with no summary turn anywhere."""
  task = procedural.generate(1, seed=6, split="heldout", level=3)[0]
  turns = task.metadata["oracle"]
  calls = []

  def policy(text):   # the oracle's turns in order (it cannot count dropped turns from the context)
    calls.append(text)
    return turns[len(calls) - 1]

  hcfg = dataclasses.replace(recipe.harness, **rl_configs.DROP_OLDEST)
  (t,) = harness.run_episodes(scripted.ScriptedEngine(tok, policy), tok, [task], envs, hcfg)
  assert t.metrics["solved"] == 1.0 and t.stop_reason == "finish" and len(t.segments) >= 2
  assert not any(tr["kind"] == "summary" for s in t.segments for tr in s.turns)
  assert not any(m["role"] == "summary" for m in t.messages)
  limit = hcfg.context_budget - hcfg.max_turn_tokens - hcfg.observation_reserve
  for prev, seg in zip(t.segments, t.segments[1:], strict=False):
    assert seg.prompt_len <= limit and not seg.gen_mask_T[:seg.prompt_len].any()
    prompt = tok.decode(seg.tokens_T[:seg.prompt_len].tolist(), skip_special_tokens=False)
    assert prompt.startswith(cf.BEGIN_OF_TEXT + cf.SYSTEM) and task.prompt in prompt
    last = prev.turns[-1]   # the previous segment's last turn is kept, its oldest (the todo list) dropped
    assert tok.decode(prev.tokens_T[last["start"]:last["gen_end"]].tolist(), skip_special_tokens=False) in prompt
    assert '"add"' not in prompt
  with pytest.raises(ValueError, match="unknown overflow 'drop'"):
    dataclasses.replace(hcfg, overflow="drop")


def test_oracle_edits_are_unique_and_fit_the_turn_budget_when_a_buggy_line_is_shared(recipe, tok, envs):
  """Levels 2-3 put several functions in a file, and about 1 task in 400 has a buggy line another function shares:
  the oracle's edit then quotes the docstring line too. Every edit matches exactly once, the turn fits the recipe's
  max_turn_tokens (the whole header did not at 64), and the oracle solves those tasks under the recipe's harness."""
  shared = []
  for lv in (2, 3):
    for task in procedural.generate(300, seed=1, split="train", level=lv):
      for turn in task.metadata["oracle"]:
        for call in turn["tool_calls"]:
          if call["name"] != "edit":
            continue
          text, old = task.environment.files[call["arguments"]["path"]], call["arguments"]["old"]
          assert text.count(old) == 1
          line = old.splitlines()[-1].strip()
          if line.startswith("return") and text.count(line) > 1:
            shared.append((task, turn))
  assert len(shared) >= 2
  for _, turn in shared:
    assert sum(cf.encode_messages(tok, [{"role": "assistant", **turn}])[1]) <= recipe.harness.max_turn_tokens
  tasks = list({t.id: t for t, _ in shared}.values())
  trajs = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks)), tok, tasks, envs,
                               recipe.harness)
  assert all(t.metrics["solved"] == 1.0 for t in trajs), [t.metrics for t in trajs]
