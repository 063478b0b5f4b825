"""What the trainer and the worker processes both build from a `RunConfig`: tokenizer, task pools, workspaces.

Tasks come from the one task-source registry (`rollout.tasks.registry`): the training pool is `cfg.tasks` (its
'train' side), held-out tasks are the same source's 'heldout' side. A pool of a finite source (mined, swe, file) is
loaded once and frozen into the workdir (`tasks_<split>.json`), so worker processes and restarts train on exactly
the tasks the trainer saw, and nothing is mined twice.
"""
from __future__ import annotations

import dataclasses
import json
import os

from composer_jax import configs
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import workdir as workdir_lib
from composer_jax.rl.config import RunConfig
from composer_jax.train import tokenizer as tokenizer_lib
from rollout.tasks import registry
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task
from rollout.workspace import make_factory


def heldout_spec(cfg: RunConfig, n: int | None = None) -> registry.SetSpec:
  """The held-out side of the run's task source (procedural: another seed too; at most `n` or `eval.tasks`)."""
  return dataclasses.replace(cfg.tasks, split="heldout", seed=cfg.tasks.seed + 1, n=n or cfg.eval.tasks)


def _load(cfg: RunConfig, spec: registry.SetSpec, log=print) -> list[Task]:
  if spec.kind == "procedural":   # generated, cheap and deterministic
    return registry.load_tasks(spec, None, log)
  path = os.path.join(cfg.workdir, f"tasks_{spec.split}_{spec.n}.json")
  if os.path.exists(path):
    with open(path) as f:
      frozen = json.load(f)
    now = json.loads(json.dumps(configs.to_dict(spec)))   # as JSON stores it (tuples become lists)
    if frozen["spec"] != now:
      diff = {k: (v, now.get(k)) for k, v in frozen["spec"].items() if now.get(k) != v}
      raise ValueError(f"{path} froze the tasks of another task source {diff} (frozen, now): use a new workdir")
    return [Task.from_dict(d) for d in frozen["tasks"]]
  envs = make_envs(cfg)
  try:
    tasks = registry.load_tasks(spec, envs, log)
  finally:
    envs.factory.close()
  os.makedirs(cfg.workdir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump({"spec": configs.to_dict(spec), "tasks": [t.to_dict() for t in tasks]}, f)
  os.replace(path + ".tmp", path)
  return tasks


def train_pool(cfg: RunConfig) -> list[Task]:
  pool = _load(cfg, cfg.tasks)
  if not pool:
    raise ValueError(f"the {cfg.tasks.kind!r} task source has no training tasks ({cfg.tasks})")
  return pool


def heldout_tasks(cfg: RunConfig, n: int | None = None) -> list[Task]:
  return _load(cfg, heldout_spec(cfg, n))


def of_levels(tasks: list[Task], levels) -> list[Task]:
  """The tasks of those procedural levels (`metadata['level']`), in order."""
  return [t for t in tasks if t.metadata.get("level") in levels]


def make_envs(cfg: RunConfig) -> EnvironmentCache:
  return EnvironmentCache(make_factory(cfg.rollout.workspaces))


def batch_config(cfg: RunConfig) -> rl_batch.BatchConfig:
  """A step's batch shape: `batch_rows` segments of up to context_budget tokens, packed into `rl.pack_rows`."""
  return rl_batch.BatchConfig(rows=cfg.batch_rows, length=cfg.harness.context_budget, pack_rows=cfg.rl.pack_rows,
                              n_moe_layers=cfg.model.num_hidden_layers - cfg.model.first_k_dense_replace,
                              top_k=cfg.model.num_experts_per_tok)


def queue_url(cfg: RunConfig) -> str:
  return f"file://{os.path.join(os.path.abspath(cfg.workdir), 'queue')}"


def tokenizer_dir(cfg: RunConfig) -> str:
  return os.path.join(cfg.workdir, "tokenizer")


def load_run_config(workdir: str) -> RunConfig:
  cfg = workdir_lib.stored_config(workdir)
  if cfg is None:
    raise FileNotFoundError(f"{workdir}/{workdir_lib.RUN_CONFIG} does not exist: not an RL run's workdir")
  if not isinstance(cfg, RunConfig):
    raise TypeError(f"{workdir}/{workdir_lib.RUN_CONFIG} holds a {type(cfg).__name__}, not a RunConfig")
  return cfg


def load_tokenizer(cfg: RunConfig):
  return tokenizer_lib.load_tokenizer(tokenizer_dir(cfg))
