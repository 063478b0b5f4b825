"""experiments/eval_main.py as a user runs it: an interrupted run (process killed mid-set) resumes without re-running
finished tasks; two checkpoints (a tiny random model in the LM-stage layout and in the RL-run published layout) are
evaluated through the embedded JAX engine next to their baselines and appear on the Pareto plot with
cost = active params x tokens."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = [sys.executable, os.path.join(ROOT, "experiments", "eval_main.py")]


def _env():
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one CPU device is enough for a tiny model
  return env


def _lines(path):
  return open(path).read().splitlines() if os.path.exists(path) else []


def test_killed_run_resumes_without_rerunning_finished_tasks(tmp_path):
  out = tmp_path / "out"
  args = MAIN + ["--config=experiments/configs/eval.py:procedural,n_tasks=8,samples=2,chunk_tasks=1,policies=oracle",
                 f"--config.out={out}", "--config.tokenizer.train_tasks=40"]
  results = out / "procedural-L1-heldout" / "oracle" / "results.jsonl"
  proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
  deadline = time.time() + 240
  while len(_lines(results)) < 2 and proc.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  before = _lines(results)
  assert 2 <= len(before) < 8, f"the kill should land mid-run, saw {len(before)} finished tasks"
  done = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert f"resuming: {len(before)}/8 tasks already done" in done.stdout
  after = _lines(results)
  assert after[:len(before)] == before  # finished tasks untouched
  ids = [json.loads(x)["task_id"] for x in after]
  assert len(ids) == 8 and len(set(ids)) == 8  # each task exactly once: none re-run
  summary = json.loads((out / "procedural-L1-heldout" / "summary.json").read_text())
  assert summary["oracle"]["pass@1"] == 1.0 and summary["oracle"]["n_tasks"] == 8


def test_checkpoint_is_evaluated_and_plotted_with_baselines(tmp_path):
  workdir = tmp_path / "ckpt"
  script = f"""
import jax
import numpy as np
from composer_jax import configs
from composer_jax.model import params as P
from composer_jax.model.config import ModelConfig
from composer_jax.train import stages, tokenizer as T
from experiments.configs import model as M
from rollout import harness
from rollout.tasks import procedural
cfg = configs.from_dict(ModelConfig, M.get_config("tiny").to_dict())
texts = [f for t in procedural.generate(40, level=1) for f in t.environment.files.values()] + [harness.SYSTEM_PROMPT]
tc = T.TokenizerConfig(vocab_size=cfg.vocab_size)
T.save_tokenizer(T.train_tokenizer(texts, tc), "{workdir}/tokenizer", tc)
rng = np.random.default_rng(0)  # host-side random weights: no initialiser compile
stages.export_params("{workdir}", jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape)).astype(a.dtype),
                                               P.abstract_params(cfg)))
# The same model as an RL run publishes it (composer_jax/rl/weight_files.py layout), other weights, version 5.
import json, os, shutil
rl = "{workdir}_rl"
os.makedirs(rl + "/weights")
shutil.copytree("{workdir}/tokenizer", rl + "/tokenizer")
leaves = jax.tree_util.tree_leaves_with_path(P.abstract_params(cfg))
np.savez(rl + "/weights/v5.npz", **{{jax.tree_util.keystr(p): (0.02 * rng.standard_normal(a.shape)).astype(a.dtype)
                                    for p, a in leaves}})
json.dump({{"version": 5, "path": "v5.npz"}}, open(rl + "/weights/latest.json", "w"))
print(P.count_params(cfg)[1])
"""
  made = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=300)
  assert made.returncode == 0, made.stderr[-2000:]
  active = int(made.stdout.split()[-1])
  out = tmp_path / "out"
  run = subprocess.run(MAIN + ["--config=experiments/configs/eval.py:procedural,n_tasks=2,samples=1,"
                               "policies=oracle+noop+checkpoint,model=tiny,workspaces=local",
                               f"--config.checkpoint.workdir={workdir}:{workdir}_rl", f"--config.out={out}",
                               "--config.harness.max_turn_tokens=96", "--config.harness.max_turns=3",
                               "--config.harness.observation_reserve=128", "--config.harness.context_budget=1024"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=500)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  summary = json.loads((out / "procedural-L1-heldout" / "summary.json").read_text())
  assert set(summary) == {"ckpt:ckpt@v0", "ckpt:ckpt_rl@v5", "oracle", "noop"}
  for name in ("ckpt:ckpt@v0", "ckpt:ckpt_rl@v5"):
    ck = summary[name]
    assert ck["output_tokens"] > 0 and ck["cost"] == pytest.approx(active * ck["output_tokens"])
  assert summary["oracle"]["pass@1"] == 1.0 and summary["noop"]["pass@1"] == 0.0
  assert (out / "procedural-L1-heldout" / "pareto.png").read_bytes()[:4] == b"\x89PNG"
  assert "ckpt:ckpt_rl@v5" in run.stdout


@pytest.mark.parametrize("preset, variant", [("rl_colab", "colab"), ("rl", "recipe_best")])
def test_rl_harness_presets_match_their_rl_runs(preset, variant):
  """`harness=rl_colab` / `harness=rl` evaluate an RL checkpoint in the loop it was trained in (make colab's, make
  run's); unknown presets are errors."""
  from experiments.configs import eval as eval_config
  from experiments.configs import rl as rl_config
  h, rl = eval_config.get_config(f"procedural,harness={preset}").harness, rl_config.get_config(variant).harness
  keys = ("context_budget", "max_turn_tokens", "observation_reserve", "max_turns", "max_segments",
          "summary_max_tokens", "summary_prompt", "system_prompt")
  assert {k: h.get(k) for k in keys} == {k: rl.get(k) for k in keys}
  assert h.tools.max_output_chars == rl.tools.max_output_chars
  assert h.system_prompt == "short" and h.max_segments == (1 if preset == "rl_colab" else 4)
  assert eval_config.get_config("procedural").harness.system_prompt == "full"
  with pytest.raises(ValueError, match="harness preset"):
    eval_config.get_config("procedural,harness=huge")


@pytest.mark.parametrize("args, message", [
  ([], "--config is required"),
  (["--config=experiments/configs/eval.py:file"], "no set file given"),
  (["--config=experiments/configs/eval.py:procedural,samples=two"], "'samples' expects int (like 2), got 'two'"),
  (["--config=experiments/configs/eval.py:mined,repos=/nonexistent,policies=oracle+noopp"],  # before any mining
   "unknown policies ['noopp']"),
])
def test_bad_input_gets_a_clear_error(args, message):
  run = subprocess.run(MAIN + args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
  assert run.returncode != 0 and message in run.stdout + run.stderr, run.stderr[-1500:]
  assert "AttributeError" not in run.stderr and "FileNotFoundError: ''" not in run.stderr


def test_build_set_makes_its_directory_and_refuses_to_write_an_empty_set(tmp_path):
  """The docs' `build_set=sets/a_v1.json` where there is no sets/: a traceback after mining; filters that exclude
  every task: "wrote 0 tasks" with exit 0. Now the directory is made first, and an empty set is an error."""
  from tests.tasks_testlib import commit, init_repo
  repo = tmp_path / "repo"
  init_repo(repo)
  commit(repo, {"calc.py": "def one():\n    return 1\n", "tests/test_one.py": "def test_one():\n    pass\n"}, "Start")
  commit(repo, {"calc.py": "def one():\n    return 1\n\n\ndef two():\n    return 2\n",
                "tests/test_two.py": "from calc import two\n\n\ndef test_two():\n    assert two() == 2\n"},
         "Add two to calc")
  out = tmp_path / "sets" / "a_v1.json"
  env = dict(_env(), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
  cmd = MAIN + [f"--config=experiments/configs/eval.py:mined,repos={repo},build_set={out},workspaces=local"]
  empty = subprocess.run(cmd + ["--config.builder.min_files=99"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
  assert empty.returncode == 2 and "Traceback" not in empty.stderr, empty.stderr[-2000:]
  assert "error: no mined task passed the filters (min_files=99" in empty.stderr and not out.exists()
  built = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert built.returncode == 0, built.stderr[-2000:]
  assert json.loads(out.read_text())["tasks"] and f"wrote 1 tasks to {out}" in built.stdout
