r"""The project's main job: SFT warm start on oracle trajectories, asynchronous RL, held-out evaluation.

  python experiments/rl_main.py                          # rl.py:recipe_best (make run), embedded JAX engine, bubblewrap
  python experiments/rl_main.py --config=experiments/configs/rl.py:colab --workdir=runs/rl_colab   # make colab
  python experiments/rl_main.py --config.rl.loss.kl_coef=0.01      # one ablation of configs/rl.py:get_sweep()

The last line printed is JSON (also workdir/results.json): success (with 95% CI, per level of a procedural mix) of
the SFT start, the RL policy and the SFT control, greedy (T0) and at T=1, and each phase's wall-clock. Metrics:
workdir/metrics.jsonl (pass/level_<n> per step), workdir/tb (TensorBoard), workdir/reward.png.

A workdir holds one run: a second run into it while it is live stops at once; rerunning the same command resumes
(Ctrl-C stops after the step in flight, checkpointed); a rerun with another config is refused with the fields that
differ, unless they are named in --resume_with_changes (e.g. `--config.rl.steps=200
--resume_with_changes=rl.steps` grows a finished run to 200 RL steps).

On a mesh: `--config.mesh.data=2 --config.mesh.expert=2` (composer_jax/rl/README.md, "On a mesh and across
processes"). Multi-process: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I to each of the N
processes (or set JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or pass --distributed_auto on
SLURM/Open MPI), with a mesh over all their devices (one axis at -1) and a workdir they all reach.
"""
import json
import os

from absl import flags, logging

from experiments import cli

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "rl.py")
_CONFIG = cli.define_config(_DEFAULT)
_WORKDIR = flags.DEFINE_string("workdir", "runs/rl", "Directory for checkpoints, queue, weights and metrics.")
_RESUME_WITH_CHANGES = flags.DEFINE_list(
    "resume_with_changes", [], "Config fields (dotted, e.g. rl.steps) a resumed run may change from the config "
    "its workdir was started with; any other difference is refused.")
_START_DISTRIBUTED = cli.define_distributed()


def main(argv):
  del argv
  from composer_jax.rl.config import RunConfig
  cfg = cli.convert(RunConfig, _CONFIG.value, workdir=_WORKDIR.value)   # a bad field fails here, before any work
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO, jax its cache set-up
  from composer_jax.compile_cache import enable_compilation_cache
  enable_compilation_cache()   # a second run skips its compiles
  _START_DISTRIBUTED()
  from composer_jax.parallel import distributed
  from composer_jax.rl import experiment
  log_fn = print if distributed.is_primary() else (lambda s: None)   # process 0 reports the run
  result = experiment.run_experiment(cfg, log_fn, allow_changes=tuple(_RESUME_WITH_CHANGES.value))
  if distributed.is_primary():
    print(json.dumps(result))


if __name__ == "__main__":
  from composer_jax.rl.config import RunInputError
  cli.run(main, example="experiments/configs/rl.py:colab", input_errors=(RunInputError,))
