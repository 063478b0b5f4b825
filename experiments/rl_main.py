r"""The project's main job: SFT warm start on oracle trajectories, asynchronous RL, held-out evaluation.

  python experiments/rl_main.py                          # rl.py:recipe_best (make run), embedded JAX engine, bubblewrap
  python experiments/rl_main.py --config=experiments/configs/rl.py:colab --workdir=runs/rl_colab   # make colab
  python experiments/rl_main.py --config.rl.loss.kl_coef=0.01      # one ablation of configs/rl.py:get_sweep()

The last line printed is JSON (also workdir/results.json): success (with 95% CI, per level of a procedural mix) of
the SFT start, the RL policy and the SFT control, greedy (T0) and at T=1, and each phase's wall-clock. Metrics:
workdir/metrics.jsonl (pass/level_<n> per step), workdir/tb (TensorBoard), workdir/reward.png.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "rl.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Config file (get_config(arg)).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/rl", "Directory for checkpoints, queue, weights and metrics.")


def main(argv):
  del argv
  from composer_jax.compile_cache import enable_compilation_cache
  enable_compilation_cache()   # a second run skips its compiles
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
  from composer_jax import configs
  from composer_jax.rl import experiment
  from composer_jax.rl.config import RunConfig
  result = experiment.run_experiment(configs.from_dict(RunConfig, _CONFIG.value, workdir=_WORKDIR.value))
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
