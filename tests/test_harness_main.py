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
