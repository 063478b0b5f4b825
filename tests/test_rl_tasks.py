"""RL (and its SFT warm start) on any task source of the registry: a small mined set from a git repository the test
builds. Mined tasks have no scripted oracle, so the warm start's demonstrations apply their gold patches."""
import json
import os
import subprocess
import sys

import pytest

from composer_jax import configs
from composer_jax.rl import loop, setup
from composer_jax.rl import workdir as workdir_lib
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs
from rollout.evaluation import policies as budget_lib
from rollout.tasks import environment, miner, procedural, registry, setfile, swe
from rollout.workspace import LocalFactory
from tests.tasks_testlib import FAST, commit, init_repo, swe_set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mined_repo(path):
  """Three commits, each adding a function with its test: two mineable tasks (the first commit is the base; the
  subjects have the three words a self-contained prompt needs)."""
  init_repo(path)
  commit(path, {"calc.py": "def one():\n    return 1\n", "tests/test_one.py": "def test_one():\n    pass\n"}, "Start")
  commit(path, {"calc.py": "def one():\n    return 1\n\n\ndef two():\n    return 2\n",
                "tests/test_two.py": "from calc import two\n\n\ndef test_two():\n    assert two() == 2\n"},
         "Add two to calc")
  commit(path, {"calc.py": "def one():\n    return 1\n\n\ndef two():\n    return 2\n\n\ndef six():\n    return 6\n",
                "tests/test_six.py": "from calc import six\n\n\ndef test_six():\n    assert six() == 6\n"},
         "Add six to calc")
  return str(path)


@pytest.mark.slow   # ~105 s on the loaded 2-core machine: mining runs pytest twice per side of each commit
def test_sync_rl_on_a_mined_set_with_gold_patch_demonstrations(tmp_path):
  repo = _mined_repo(tmp_path / "repo")
  c = rl_configs.get_config(f"test,mode=sync,tasks=mined,repos={repo}")
  assert c.tasks.kind == "mined" and c.tasks.n == 0
  cfg = configs.from_dict(RunConfig, c, workdir=str(tmp_path / "run"))
  # A gold-patch turn (write_file of a unified diff) is longer than a procedural edit: room for it.
  cfg = configs.replace(cfg, **{"tasks.miner": FAST, "tasks.heldout_percent": 1, "rl.steps": 2,
                                "rl.ckpt_every": 2, "harness.context_budget": 1000, "harness.max_turn_tokens": 400,
                                "harness.summary_max_tokens": 400, "harness.tools.max_output_chars": 200,
                                "sft.seq_len": 512})
  out = loop.run_rl(cfg, log_fn=lambda s: None)
  pool = setup.train_pool(cfg, None)
  assert sorted(t.prompt for t in pool) == ["Add six to calc", "Add two to calc"]
  assert (tmp_path / "run" / "tasks_train_0.json").exists()      # frozen once: workers read the same pool
  demos = [json.loads(line)["messages"] for line in open(tmp_path / "run" / "sft" / "sft_train.jsonl")]
  calls = [c for m in demos for turn in m if turn["role"] == "assistant" for c in turn.get("tool_calls") or []]
  patches = [c["arguments"]["content"] for c in calls if c["name"] == "write_file"]
  assert len(patches) == len(demos) == 2 and all(p.startswith("diff --git") for p in patches)
  assert sorted(t.gold_patch for t in pool) == sorted(patches)    # the demonstrations are the gold patches
  applied = [json.loads(line) for line in open(tmp_path / "run" / "applied.jsonl")]
  assert [r["step"] for r in applied] == [1, 2] and int(out["last"]["step"]) == 2
  assert all(len(r["keys"]) == cfg.rl.groups_per_step for r in applied)


def test_file_task_source_from_the_command_line_arg():
  c = rl_configs.get_config("colab,tasks=file,set_file=sets/x_v1.json")
  cfg = configs.from_dict(RunConfig, c, workdir="/tmp/unused")
  assert (cfg.tasks.kind, cfg.tasks.path, cfg.tasks.split, cfg.sft.demo_accuracy) == ("file", "sets/x_v1.json",
                                                                                       "train", 1.0)
  assert setup.heldout_spec(cfg).split == "heldout" and setup.heldout_spec(cfg).n == cfg.eval.tasks
  mix = configs.from_dict(RunConfig, rl_configs.get_config("colab,levels=1+2"), workdir="/tmp/unused")
  assert mix.tasks.levels == (1, 2) and mix.tasks.seed == mix.seed + 1


def test_a_finite_pool_is_frozen_once_and_checked_against_the_config(tmp_path):
  from rollout.tasks import procedural, registry
  calls = []

  @registry.register("rl_test_source")
  def _load(spec, envs, log):
    calls.append(spec.split)
    return procedural.generate(12, seed=3, split="train")
  try:
    cfg = configs.from_dict(RunConfig, rl_configs.get_config("test"), workdir=str(tmp_path))
    cfg = configs.replace(cfg, **{"tasks.kind": "rl_test_source", "tasks.n": 0})
    pool = setup.train_pool(cfg, None)
    assert [t.id for t in setup.train_pool(cfg, None)] == [t.id for t in pool] and calls == ["train"]   # read back
    held = setup.heldout_tasks(cfg, None)
    assert {t.id for t in held}.isdisjoint(t.id for t in pool) and len(held) + len(pool) == 12
    other = configs.replace(cfg, **{"tasks.heldout_percent": 50})
    with pytest.raises(ValueError, match=r"another task source \{'heldout_percent': \(20, 50\)\}"):
      setup.train_pool(other, None)
  finally:
    del registry.SOURCES["rl_test_source"]


def _set_file(path, tasks):
  dicts = [t.to_dict() for t in tasks]
  setfile.write_set(str(path), {"format": setfile.FORMAT, "name": path.stem, "version": "1", "tasks": dicts,
                                "sha256": setfile.tasks_digest(dicts)})
  return path


def _rl_main(*args, timeout=900):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "rl_main.py"), *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_a_set_without_held_out_tasks_is_refused_before_any_work(tmp_path):
  """The README's `tasks=file` command on a set too small for a held-out side: one line at once (it failed ~3 min
  in, after SFT and RL)."""
  tasks = [t for t in procedural.generate(12, seed=1, split="train", level=1) if registry.split_of(t, 20) == "train"]
  path = _set_file(tmp_path / "small_v1.json", tasks[:3])
  r = _rl_main(f"--config=experiments/configs/rl.py:colab,tasks=file,set_file={path}", f"--workdir={tmp_path / 'run'}")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert r.stderr.strip() == ("error: the 'file' task source has no held-out tasks to evaluate on (3 training tasks "
                              "at tasks.heldout_percent=20): raise tasks.heldout_percent or use a bigger set")
  assert not (tmp_path / "run" / "sft").exists()
  # Nothing that a fixed rerun (a bigger tasks.heldout_percent) would be refused against: no stored config, no pool.
  assert sorted(os.listdir(tmp_path / "run")) == ["lock"]


@pytest.mark.slow   # 10-15 min on the loaded 2-core machine: demonstrations, 20 SFT steps, 2 RL steps, 2 evaluations
def test_the_readmes_task_file_command_runs_end_to_end(tmp_path):
  """`rl_main.py --config=experiments/configs/rl.py:colab,tasks=file,set_file=...` as the README writes it, sized
  down by flags: the warm start, RL and the held-out evaluation of both policies run on a 40-task set file."""
  path = _set_file(tmp_path / "x_v1.json", procedural.generate(40, seed=1, split="train", level=1))
  run = tmp_path / "run"
  r = _rl_main(f"--config=experiments/configs/rl.py:colab,tasks=file,set_file={path}", f"--workdir={run}",
               "--config.sft.steps=20", "--config.rl.steps=2", "--config.eval.tasks=4",
               "--config.eval.temperatures=(1.0,)", "--config.eval.control=False", "--config.progress_bar=False",
               timeout=1800)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  result = json.loads(r.stdout.strip().splitlines()[-1])
  held = len(setup.heldout_tasks(workdir_lib.load_run_config(str(run)), None))
  assert result["eval_tasks"] == held and 0 < held <= 4
  assert all(result[p]["T1"]["n"] == held for p in ("sft", "rl"))
  assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2]


def test_a_repository_sets_oracle_that_does_not_fit_the_budgets_is_refused_naming_the_flags(tmp_path):
  """The issue's mined and SWE sets: `max_turn_tokens=48` cut the oracle's write_file of the gold patch, reported
  minutes in as "the oracle failed 4 tasks: check the sandbox/grader". Now checked before the demonstrations, where
  the run's tokenizer is read (`setup.run_tokenizer`; here the one already in the workdir)."""
  from composer_jax.rl.config import RunInputError
  from composer_jax.train import tokenizer as tokenizer_lib
  from rollout.tasks.task import Environment, HiddenTests, Task
  body = "".join(f"+def helper_{i}(x):\n+    return x * {i} + {i * 7}\n" for i in range(2))
  task = Task(id="m/1", language="python", prompt="Add helpers", environment=Environment(files={"calc.py": ""}),
              tests=HiddenTests(command="pytest", fail_to_pass=("tests/test_calc.py::test_h",)),
              gold_patch=f"diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -0,0 +1,60 @@\n{body}")
  tok = tokenizer_lib.train_tokenizer([task.gold_patch], tokenizer_lib.TokenizerConfig(vocab_size=512))
  tokenizer_lib.save_tokenizer(tok, setup.tokenizer_dir(str(tmp_path)))
  colab = configs.from_dict(RunConfig, rl_configs.get_config("colab,tasks=file,set_file=x.json"),
                            workdir=str(tmp_path))
  small = configs.replace(colab, **{"harness.max_turn_tokens": 48, "harness.summary_max_tokens": 48,
                                    "harness.context_budget": 320})
  with pytest.raises(RunInputError, match=r"harness\.max_turn_tokens=48, harness\.context_budget=320; its gold "
                                          r"patches need (\d+) and (\d+)\): rerun with --config\.harness\."
                                          r"max_turn_tokens=\1 --config\.harness\.summary_max_tokens=\1 "
                                          r"--config\.harness\.context_budget=\2"):
    setup.run_tokenizer(small, [task])
  need = max(budget_lib.oracle_turn_tokens(task, tok))
  assert 48 < need <= colab.harness.max_turn_tokens   # rl.py's budgets for repository sources hold this one
  setup.run_tokenizer(colab, [task])
  setup.run_tokenizer(configs.from_dict(RunConfig, rl_configs.get_config("colab"), workdir=str(tmp_path)), [task])


@pytest.mark.slow   # ~6 min on the loaded 2-core machine: mining, demonstrations, 20 SFT steps, 2 RL steps, 2 evals
def test_the_readmes_mined_command_runs_end_to_end(tmp_path):
  """`rl_main.py --config=experiments/configs/rl.py:colab,tasks=mined,repos=...` as the README writes it, sized down
  by flags, on a two-task repository; the held-out share is the one that puts one task on each side (sides follow
  the tasks' gold diffs, mined here the same way)."""
  repo = _mined_repo(tmp_path / "repo")
  mined, _ = miner.mine(str(repo), environment.EnvironmentCache(LocalFactory()), FAST, log=lambda s: None)
  percent = next(p for p in range(1, 100) if {registry.split_of(t, p) for t in mined} == {"train", "heldout"})
  run = tmp_path / "run"
  r = _rl_main(f"--config=experiments/configs/rl.py:colab,tasks=mined,repos={repo}", f"--workdir={run}",
               f"--config.tasks.heldout_percent={percent}", "--config.sft.steps=20", "--config.rl.steps=2",
               "--config.eval.temperatures=(1.0,)", "--config.eval.control=False", "--config.progress_bar=False",
               timeout=1800)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  result = json.loads(r.stdout.strip().splitlines()[-1])
  assert result["eval_tasks"] == 1 and all(result[p]["T1"]["n"] == 1 for p in ("sft", "rl"))
  assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2]


def test_a_one_instance_swe_file_is_refused_before_any_work(tmp_path):
  """The issue's 1-instance SWE file: a finite set's sides follow its gold patches, so one instance is on one side
  only, and RL (which trains on one side and evaluates on the other) is refused in one line naming the field, at
  any share held out, before any demonstration."""
  from composer_jax.rl.config import RunInputError
  jsonl, repos = swe_set(tmp_path, 1)
  (task,) = swe.load_jsonl(jsonl, repos)
  command = f"tasks=swe,jsonl={jsonl},repos_dir={repos}"

  def refusal(percent):
    if registry.split_of(task, percent) == "train":
      return (f"the 'swe' task source has no held-out tasks to evaluate on (1 training tasks at "
              f"tasks.heldout_percent={percent}): raise tasks.heldout_percent or use a bigger set")
    return (f"the 'swe' task source has no training tasks at tasks.heldout_percent={percent} (a finite set's sides "
            "follow its tasks' gold patches): lower tasks.heldout_percent or use a bigger set")
  r = _rl_main(f"--config=experiments/configs/rl.py:colab,{command}", f"--workdir={tmp_path / 'run'}")
  assert r.returncode == 2 and r.stderr.strip() == f"error: {refusal(20)}", r.stderr[-3000:]
  assert sorted(os.listdir(tmp_path / "run")) == ["lock"]
  colab = configs.from_dict(RunConfig, rl_configs.get_config(f"colab,{command}"), workdir=str(tmp_path / "in"))
  sides = set()
  for percent in (1, 20, 50, 99):
    sides.add(registry.split_of(task, percent))
    cfg = configs.replace(colab, **{"tasks.heldout_percent": percent})
    with pytest.raises(RunInputError) as e, setup.open_run(cfg):
      pass
    assert str(e.value) == refusal(percent)
  assert sides == {"train", "heldout"}   # both refusals were checked


@pytest.mark.slow   # ~8 min on the loaded 2-core machine: demonstrations, 20 SFT steps, 2 RL steps, 2 evaluations
def test_the_readmes_swe_command_runs_end_to_end(tmp_path):
  """`rl_main.py --config=experiments/configs/rl.py:colab,tasks=swe,jsonl=...,repos_dir=...` as the README writes
  it, sized down by flags, on a 4-instance SWE-style file against one local clone: the oracle applies each gold
  patch in a sandbox and the hidden tests (the test patch, then pytest) pass; SFT, RL and the held-out evaluation
  run (the issue's run failed on the oracle, then on "no held-out tasks" minutes in)."""
  jsonl, repos = swe_set(tmp_path, 4)
  sides = [registry.split_of(t, 20) for t in swe.load_jsonl(jsonl, repos)]
  run = tmp_path / "run"
  r = _rl_main(f"--config=experiments/configs/rl.py:colab,tasks=swe,jsonl={jsonl},repos_dir={repos}",
               f"--workdir={run}", "--config.sft.steps=20", "--config.rl.steps=2",
               "--config.eval.temperatures=(1.0,)", "--config.eval.control=False", "--config.progress_bar=False",
               timeout=1800)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  result = json.loads(r.stdout.strip().splitlines()[-1])
  assert result["eval_tasks"] == sides.count("heldout") > 0 and sides.count("train") > 0
  assert all(result[p]["T1"]["n"] == result["eval_tasks"] for p in ("sft", "rl"))
  demos = [json.loads(line)["messages"] for line in open(run / "sft" / "sft_train.jsonl")]
  assert len(demos) == sides.count("train")   # every training instance's oracle solved it (else the run stops)
  assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2]
