r"""Per-token vs per-tensor scaling ablation for low-precision MoE matmuls; writes a PNG, a table and JSON.

  python experiments/quant_ablation_main.py --config=experiments/configs/quant_ablation.py:colab \
      --workdir=runs/quant_ablation
"""

from absl import flags

from experiments import cli

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for quant_ablation.{png,md,json}.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from composer_jax.quant_ablation import AblationConfig, run
  cfg = cli.convert(AblationConfig, _CONFIG.value.ablation, "ablation.")   # a bad field fails here, before any work
  from composer_jax.compile_cache import enable_compilation_cache
  enable_compilation_cache()   # a second run skips its compiles
  run(cfg, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main, example="experiments/configs/quant_ablation.py:colab")
