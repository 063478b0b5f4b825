r"""Per-token vs per-tensor scaling ablation for low-precision MoE matmuls; writes a PNG, a table and JSON.

  python experiments/quant_ablation_main.py --config=experiments/configs/quant_ablation.py:colab \
      --workdir=runs/quant_ablation
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for quant_ablation.{png,md,json}.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from composer_jax.compile_cache import enable_compilation_cache
  enable_compilation_cache()   # a second run skips its compiles
  from composer_jax import configs
  from composer_jax.quant_ablation import AblationConfig, run
  run(configs.from_dict(AblationConfig, _CONFIG.value.ablation, "ablation."), _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
