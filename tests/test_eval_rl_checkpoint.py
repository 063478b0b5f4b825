"""The evaluation README's command for `make colab`'s policy runs as written on an RL workdir of rl.py:colab's
shape. The issue's form of it (`checkpoint=runs/rl_colab,model=rl_colab`, evaluation's own harness) failed at the
checkpoint's first call: "prompt bucket 256 + output bucket 1024 exceed max_position_embeddings=1024"."""
import json
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from composer_jax import configs
from composer_jax.model import params as params_lib
from composer_jax.rl import publishers, setup, weight_files
from composer_jax.rl import workdir as workdir_lib
from composer_jax.rl.config import RunConfig
from composer_jax.train import tokenizer as tokenizer_lib
from experiments.configs import rl as rl_configs
from rollout.tasks import procedural, setfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _colab_run(workdir: str) -> None:
  """What `make colab` leaves for evaluation: its run config, tokenizer and published weights (random here)."""
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("colab"), workdir=workdir)
  workdir_lib.save_config(cfg)
  tok = setup.fit_tokenizer(procedural.generate(64, seed=1, split="train", level=1), cfg.harness.system_prompt,
                                cfg.tokenizer)
  tokenizer_lib.save_tokenizer(tok, setup.tokenizer_dir(cfg.workdir))
  rng = np.random.default_rng(0)   # host-side random weights: no initialiser compile
  params = jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape)).astype(a.dtype),
                        params_lib.abstract_params(cfg.model))
  weight_files.publish(publishers.weights_dir(cfg), params, 100)


@pytest.mark.slow   # the rl_colab model's decode compiles, on top of the oracle and no-op baselines
def test_the_evaluation_readmes_make_colab_command_runs_as_written(tmp_path):
  readme = open(os.path.join(ROOT, "rollout", "evaluation", "README.md")).read()
  joined = re.sub(r"\\\n", "", readme)
  (line,) = [ln for ln in joined.splitlines() if "checkpoint=runs/rl_colab" in ln and "harness=rl_colab" in ln]
  run, set_file, out = tmp_path / "rl_colab", tmp_path / "a_v1.json", tmp_path / "out"
  _colab_run(str(run))
  dicts = [t.to_dict() for t in procedural.generate(2, seed=2, split="heldout", level=1)]
  setfile.write_set(str(set_file), {"format": setfile.FORMAT, "name": "a", "version": "1", "tasks": dicts,
                                    "sha256": setfile.tasks_digest(dicts)})
  args = shlex.split(line.split("#")[0].replace("sets/a_v1.json", str(set_file)).replace("runs/rl_colab", str(run)))
  assert args[:2] == ["python", "experiments/eval_main.py"]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, *args[1:], f"--config.out={out}"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=1800)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  (summary_path,) = out.glob("*/summary.json")
  summary = json.loads(summary_path.read_text())
  (checkpoint,) = [k for k in summary if k.startswith("ckpt:")]
  assert summary[checkpoint]["n_tasks"] == 2 and summary["oracle"]["pass@1"] == 1.0, summary
