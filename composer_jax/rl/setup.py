"""What the trainer and the worker processes both build from a `RunConfig`: tokenizer, task pools, workspaces."""
from __future__ import annotations

import os
import pickle

from composer_jax.rl.config import RunConfig
from composer_jax.train import tokenizer as tokenizer_lib
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import make_factory


def train_pool(cfg: RunConfig) -> list:
  return procedural.generate(cfg.tasks.n, seed=cfg.seed + 1, split="train", level=cfg.tasks.level)


def heldout_tasks(cfg: RunConfig, n: int | None = None) -> list:
  return procedural.generate(n or cfg.eval.tasks, seed=cfg.seed + 2, split="heldout", level=cfg.tasks.level)


def make_envs(cfg: RunConfig) -> EnvironmentCache:
  return EnvironmentCache(make_factory(cfg.rollout.backend))


def queue_url(cfg: RunConfig) -> str:
  return f"file://{os.path.join(os.path.abspath(cfg.workdir), 'queue')}"


def tokenizer_dir(cfg: RunConfig) -> str:
  return os.path.join(cfg.workdir, "tokenizer")


def save_run_config(cfg: RunConfig) -> str:
  os.makedirs(cfg.workdir, exist_ok=True)
  path = os.path.join(cfg.workdir, "run_config.pkl")
  with open(path, "wb") as f:
    pickle.dump(cfg, f)
  return path


def load_run_config(workdir: str) -> RunConfig:
  with open(os.path.join(workdir, "run_config.pkl"), "rb") as f:
    cfg = pickle.load(f)
  if not isinstance(cfg, RunConfig):
    raise TypeError(f"{workdir}/run_config.pkl holds a {type(cfg).__name__}, not a RunConfig")
  return cfg


def load_tokenizer(cfg: RunConfig):
  return tokenizer_lib.load_tokenizer(tokenizer_dir(cfg))
