"""Shared by the RL mesh and multi-process tests: the RL trainer (`rl.trainer.Trainer`) on a queue of fixed groups.

It runs what the RL loop runs for a step — process 0 takes the step's groups from the queue (`sources.take_groups`),
every process trains on them (`Trainer.step`), checkpoints every `rl.ckpt_every` — with the groups written to the
queue beforehand instead of by rollout workers, so two runs see exactly the same groups.

As a script it is one process of a run (COORDINATOR '-': a single process on all its devices):
  python tests/rl_mesh_testlib.py WORKDIR STEPS KILL_AT COORDINATOR NUM_PROCESSES PROCESS_ID
KILL_AT > 0 SIGKILLs the process right after that step is trained and logged, before its checkpoint.
"""
import json
import os
import signal
import sys

import jax
import numpy as np

from composer_jax import configs, model
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.rl import placement, setup, sources
from composer_jax.rl.config import RunConfig
from composer_jax.rl.trainer import Trainer
from experiments.configs import rl as rl_configs
from rollout.queue import QueueProducer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import tree_testlib as tl  # noqa: E402

MESH = mesh_lib.MeshConfig(data=2, expert=2, context=2)


def run_config(workdir: str, steps: int) -> RunConfig:
  """`rl.py:test` (tiny model, 2 groups of 2 per step, rows of 320 tokens), a checkpoint every 2 steps."""
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("test"), workdir=workdir)
  return configs.replace(cfg, **{"rl.steps": steps, "rl.ckpt_every": 2})


def fill_queue(cfg: RunConfig, steps: int) -> None:
  """Each step's groups, versioned for that step (never stale), routing recorded for every token."""
  rng = np.random.default_rng(0)
  producer = QueueProducer(setup.queue_url(cfg.workdir), "fixed")
  n_layers = cfg.model.num_hidden_layers - cfg.model.first_k_dense_replace
  for step in range(steps):
    for g in range(cfg.rl.groups_per_step):
      group = tl.flat_group([list(rng.integers(0, tl.ENV, rng.integers(4, 40)))
                             for _ in range(cfg.rollout.samples_per_prompt)],
                            rng.integers(0, 2, cfg.rollout.samples_per_prompt).astype(float), n_layers=n_layers)
      for traj in group:
        seg = traj["segments"][0]
        seg["routed_TxNxK"] %= cfg.model.n_routed_experts
        seg["versions_T"] = np.where(seg["gen_mask_T"] > 0, step, -1).astype(np.int32)
      producer.append_group(group, task_id=f"s{step}g{g}")


def train(workdir: str, steps: int, mesh, rules, kill_at: int = 0) -> Trainer:
  """Trains (or resumes) to `steps`; process 0 appends each step's metrics to `workdir/steps.jsonl`."""
  cfg = run_config(workdir, steps)
  ref = model.init(jax.random.key(0), cfg.model, mesh, rules)   # the warm start, as the run loads it: on the mesh
  trainer = Trainer(placement.start_rl_step(cfg, mesh, rules, ref), placement.batch_config(cfg), cfg.workdir,
                    cfg.rollout.staleness, log_fn=lambda s: None)
  for step_no in range(trainer.start + 1, steps + 1):
    groups = sources.take_groups(trainer.consumer, cfg, step_no - 1) if trainer.primary else None
    m = trainer.step(step_no, groups)
    if trainer.primary:
      with open(os.path.join(workdir, "steps.jsonl"), "a") as f:
        f.write(json.dumps({"step": step_no, **m}) + "\n")
    if step_no == kill_at:
      os.kill(os.getpid(), signal.SIGKILL)
    if step_no % cfg.rl.ckpt_every == 0 or step_no == steps:
      trainer.checkpoint(step_no)
  trainer.close()
  return trainer


def steps_logged(workdir: str) -> dict[int, dict]:
  """step → its metrics (the last line wins: a resumed run logs the redone step again)."""
  with open(os.path.join(workdir, "steps.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f)}


def applied(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "applied.jsonl")) as f:
    return [json.loads(line) for line in f]


def save_params(trainer: Trainer, path: str) -> None:
  """The final params gathered to every process, written by this process for the test to compare."""
  from jax.experimental import multihost_utils
  full = multihost_utils.process_allgather(trainer.params, tiled=True)
  np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(full)[0]})


def _main(workdir: str, steps: int, kill_at: int, coordinator: str, num_processes: int, process_id: int) -> None:
  from composer_jax.parallel import distributed
  if coordinator != "-":
    distributed.initialize(distributed.DistributedConfig(coordinator_address=coordinator,
                                                         num_processes=num_processes, process_id=process_id))
    mesh_cfg = mesh_lib.MeshConfig(data=-1)
  else:
    mesh_cfg = MESH
  trainer = train(workdir, steps, mesh_lib.mesh_from_config(mesh_cfg), mesh_cfg.rules(), kill_at)
  save_params(trainer, os.path.join(workdir, f"params_{process_id}.npz"))
  print(f"process {process_id}/{jax.process_count()}: {jax.device_count()} devices, done", flush=True)


if __name__ == "__main__":
  _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
