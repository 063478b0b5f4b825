r"""Evaluates policies (scripted baselines, a JAX checkpoint, an SGLang endpoint) on a task set; see
experiments/configs/eval.py for commands, variants and expected results, composer_jax/eval_run.py for the run.

  python experiments/eval_main.py --config=experiments/configs/eval.py:procedural --config.out=runs/eval_proc
"""
import os

from experiments import cli

_CONFIG = cli.define_config()


def main(argv):
  del argv
  if _CONFIG.value is None:
    cli.fail("--config is required, e.g. --config=experiments/configs/eval.py:procedural "
             "(variants: procedural, mined, swe, file; see experiments/configs/eval.py)")
  from composer_jax import eval_run
  from composer_jax.compile_cache import enable_compilation_cache
  cfg = cli.convert(eval_run.EvalRunConfig, _CONFIG.value)   # a typo'd key or policy fails here, before anything slow
  if cfg.builder.path:   # the set file's directory (the docs' sets/) is made now, not found missing after mining
    parent = os.path.dirname(os.path.abspath(cfg.builder.path))
    if os.path.exists(parent) and not os.path.isdir(parent):
      cli.fail(f"build_set={cfg.builder.path}: {parent} is a file, not a directory")
    os.makedirs(parent, exist_ok=True)
  enable_compilation_cache()   # a second run skips its compiles
  eval_run.run(cfg)


if __name__ == "__main__":
  from composer_jax.eval_run import EvalInputError
  cli.run(main, example="experiments/configs/eval.py:procedural", input_errors=(EvalInputError,))
