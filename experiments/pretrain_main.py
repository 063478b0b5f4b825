r"""Language-model training stages (pretrain / long_context / sft) from an ml-collections config.

  python experiments/pretrain_main.py --config=experiments/configs/pretrain.py:colab --workdir=runs/pretrain_colab

Multi-process: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I to each of the N processes (or
set JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or pass --distributed_auto on SLURM/Open MPI).
"""
import os

from absl import flags, logging

from experiments import cli

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the tokenizer.")
_START_DISTRIBUTED = cli.define_distributed()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from composer_jax.train import stages
  cfg = cli.convert(stages.StageConfig, _CONFIG.value)   # a bad field fails here, before any work
  problems = [f"--workdir={_WORKDIR.value} is a file, not a directory"] if os.path.isfile(_WORKDIR.value) else []
  starts = {"checkpoint": cfg.init.checkpoint, "hf": cfg.init.hf}
  problems += [f"--config.init.{k}={v}: no such directory" for k, v in starts.items() if v and not os.path.isdir(v)]
  if problems:
    cli.fail(*problems)
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO, jax its cache set-up
  from composer_jax.compile_cache import enable_compilation_cache
  enable_compilation_cache()   # a second run skips its compiles
  _START_DISTRIBUTED()
  from composer_jax.parallel import distributed
  last = stages.run(cfg, _WORKDIR.value)
  if distributed.is_primary():
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()})


if __name__ == "__main__":
  cli.run(main, example="experiments/configs/pretrain.py:colab")
