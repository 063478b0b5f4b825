"""Shared by the mesh and multi-process training tests: a tiny model, fixed packed batches and a trainer run.

Run as a script it is one process of a multi-process run (the test starts several):
  python tests/mesh_testlib.py WORKDIR STEPS COORDINATOR NUM_PROCESSES PROCESS_ID
"""
import json
import os
import sys

import grain
import jax
import numpy as np

from composer_jax import configs
from composer_jax.model.config import ModelConfig
from composer_jax.parallel import layout
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.train import data as data_lib
from composer_jax.train import loop
from composer_jax.train.config import OptimConfig, TrainConfig
from experiments.configs import model as model_configs

B, L = 8, 32   # global batch rows, sequence length


def model_config() -> ModelConfig:
  """The tiny test model with 4 heads, so tensor=4 divides every dimension it shards."""
  c = model_configs.get_config("tiny")
  c.num_attention_heads = 4
  return configs.from_dict(ModelConfig, c.to_dict())


def train_config(steps: int) -> TrainConfig:
  # A large bias rate so the router-bias update is visible after a few steps; one checkpoint, at the last step.
  return TrainConfig(steps=steps, log_every=1, eval_every=steps, eval_batches=1, ckpt_every=100, ckpt_keep=2,
                     bias_update_rate=1e-2, progress_bar=False)


def batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """`n` global [B, L] batches: two packed documents per row (split at a random point), a random loss mask."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    tokens = rng.integers(1, 512, (B, L)).astype(np.int32)
    split = rng.integers(4, L - 8, (B, 1))
    pad = rng.integers(0, 4, (B, 1))                       # trailing padding (segment 0) on some rows
    col = np.arange(L)[None, :]
    seg = np.where(col < split, 1, 2) * (col < L - pad)
    pos = np.where(col < split, col, col - split) * (seg > 0)
    mask = (rng.random((B, L)) < 0.8) * (seg > 0)
    out.append(data_lib.add_targets({"tokens": tokens * (seg > 0), "tokens_segment_ids": seg,
                                     "tokens_positions": pos, "loss_mask": mask.astype(np.float32)}))
  return out


def _rows(batch, index: int, count: int):
  n = B // count
  return {k: v[index * n:(index + 1) * n] for k, v in batch.items()}


def train(workdir: str, steps: int, mesh, rules, model_cfg: ModelConfig | None = None):
  """Runs the trainer on `mesh`; each process feeds its rows of the fixed batches. Returns (params, last)."""
  index, count = layout.process_batch_shard(layout.batch_sharding(mesh, rules))
  train_ds = grain.MapDataset.source(batches(8)).map(lambda b: _rows(b, index, count)).to_iter_dataset()
  eval_ds = grain.MapDataset.source(batches(2, seed=1)).map(lambda b: _rows(b, index, count)).to_iter_dataset()
  return loop.train(model_cfg=model_cfg or model_config(), train_cfg=train_config(steps),
                    optim_cfg=OptimConfig(warmup_steps=2), workdir=workdir, train_iter=iter(train_ds),
                    eval_batches=lambda: iter(eval_ds), mesh=mesh, rules=rules, log_fn=lambda s: None)


def logged(workdir: str) -> dict[int, dict]:
  """step → the metrics row logged for it (the last one wins, as a resumed run re-logs)."""
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      rows[row["step"]] = row
  return rows


def _worker(workdir: str, steps: int, coordinator: str, num_processes: int, process_id: int) -> None:
  from composer_jax.parallel import distributed
  distributed.initialize(distributed.DistributedConfig(coordinator_address=coordinator, num_processes=num_processes,
                                                       process_id=process_id))
  cfg = mesh_lib.MeshConfig(data=-1)
  params, _ = train(workdir, steps, mesh_lib.mesh_from_config(cfg), cfg.rules())
  # Every process saves the params it can see, gathered to host memory, for the test to compare.
  from jax.experimental import multihost_utils
  full = multihost_utils.process_allgather(params, tiled=True)
  np.savez(os.path.join(workdir, f"params_{process_id}.npz"),
           **{jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(full)[0]})
  print(f"process {process_id}/{jax.process_count()}: {jax.device_count()} devices, done", flush=True)


if __name__ == "__main__":
  _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
