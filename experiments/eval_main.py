r"""Evaluates policies (scripted baselines, a JAX checkpoint, an SGLang endpoint) on a task set; see
experiments/configs/eval.py for commands, variants and expected results, composer_jax/eval_run.py for the run.

  python experiments/eval_main.py --config=experiments/configs/eval.py:procedural --config.out=runs/eval_proc
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).", lock_config=True)


def main(argv):
  del argv
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=experiments/configs/eval.py:procedural "
                         "(variants: procedural, mined, swe, file; see experiments/configs/eval.py)")
  from composer_jax import configs, eval_run
  from composer_jax.compile_cache import enable_compilation_cache
  try:
    cfg = configs.from_dict(eval_run.EvalConfig, _CONFIG.value)
  except ValueError as e:   # a typo'd key or policy fails here, before anything slow
    raise app.UsageError(str(e)) from None
  enable_compilation_cache()   # a second run skips its compiles
  try:
    eval_run.run(cfg)
  except eval_run.EvalInputError as e:
    raise app.UsageError(str(e)) from None


if __name__ == "__main__":
  app.run(main)
