r"""Runs policies through the agent harness on a task source and prints transcripts, rewards and breakdowns.

  python experiments/agent_main.py --config=experiments/configs/agent.py:colab
"""

from experiments import cli

_CONFIG = cli.define_config()


def main(argv):
  del argv
  if _CONFIG.value is None:
    cli.fail("--config is required, e.g. --config=experiments/configs/agent.py:colab")
  from composer_jax import agent_demo
  from composer_jax.compile_cache import enable_compilation_cache
  cfg = cli.convert(agent_demo.DemoConfig, _CONFIG.value)   # a bad field fails here, before any work
  enable_compilation_cache()   # a second run skips its compiles
  agent_demo.run(cfg)


if __name__ == "__main__":
  cli.run(main, example="experiments/configs/agent.py:colab")
