"""experiments/agent_main.py end to end: the oracle scores 100%, the no-op and a random-init model 0%."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_agent_main_colab():
  out = subprocess.run(
    [sys.executable, "experiments/agent_main.py", "--config=experiments/configs/agent.py:colab,n_tasks=6"],
    cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
  assert out.returncode == 0, out.stderr[-2000:]
  solved = dict(re.findall(r"^\[(\w+)\] n_tasks=.* pass@1=(\S+)", out.stdout, re.MULTILINE))
  assert solved == {"oracle": "1.000", "noop": "0.000", "model": "0.000"}, out.stdout[-3000:]
  assert "[assistant]" in out.stdout and "-> edit(" in out.stdout  # transcripts are printed


def test_the_rollout_readmes_summarization_command_is_solved_by_the_oracle():
  """rollout/README.md's `agent.py:colab,level=4,budget=...` as written (oracle only, plain-directory workspaces):
  the oracle solves every task through its self-summaries. At the budget it once named (640) the oracle solved 0/16,
  then the summary request did not fit."""
  from composer_jax import agent_demo, configs
  from experiments.configs import agent
  readme = open(os.path.join(ROOT, "rollout", "README.md")).read()
  (arg,) = re.findall(r"agent_main\.py --config=experiments/configs/agent\.py:(colab,level=4,budget=\d+)", readme)
  cfg = configs.from_dict(agent_demo.DemoConfig, agent.get_config(f"{arg},policies=oracle,workspaces=local"))
  summary = agent_demo.run(cfg, log=lambda s: None)["oracle"]
  assert summary["n_tasks"] == 16 and summary["pass@1"] == 1.0, summary
