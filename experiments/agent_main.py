r"""Runs policies through the agent harness on a task source and prints transcripts, rewards and breakdowns.

  python experiments/agent_main.py --config=experiments/configs/agent.py:colab
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).", lock_config=True)


def main(argv):
  del argv
  from composer_jax import agent_demo, configs
  from composer_jax.compile_cache import enable_compilation_cache
  enable_compilation_cache()   # a second run skips its compiles
  agent_demo.run(configs.from_dict(agent_demo.DemoConfig, _CONFIG.value))


if __name__ == "__main__":
  app.run(main)
