"""What an RL run checks before it spends time: its task sets load and have held-out tasks, and its budgets fit the
oracle demonstrations of a finite set. Each problem is a `RunInputError` naming the field to change, raised before
the minutes of demonstrations, SFT and RL that would otherwise end in it."""
from __future__ import annotations

import glob
import os

from composer_jax.rl import setup
from composer_jax.rl.config import RunConfig, RunInputError
from composer_jax.sampling.engine import bucket
from rollout.evaluation import budget
from rollout.tasks import miner

# What a task source raises on bad input: a missing or malformed file, a path that is not a repository.
_LOAD_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, miner.MiningError)


def check_tasks(cfg: RunConfig) -> tuple[list, list]:
  """The training pool and the held-out tasks (finite sources are frozen into the workdir on first load); raises
  `RunInputError` when either cannot load or is empty, leaving no frozen pool behind (a rerun with the set or
  `tasks.heldout_percent` fixed must not find the refused one frozen)."""
  frozen = set(glob.glob(os.path.join(cfg.workdir, "tasks_*.json")))
  try:
    try:
      pool = setup.train_pool(cfg)
      heldout = setup.heldout_tasks(cfg)
    except RunInputError:
      raise
    except _LOAD_ERRORS as e:
      raise RunInputError(f"cannot load the {cfg.tasks.kind!r} task source: {e}") from None
    if not heldout:
      raise RunInputError(f"the {cfg.tasks.kind!r} task source has no held-out tasks to evaluate on "
                          f"({len(pool)} training tasks at tasks.heldout_percent={cfg.tasks.heldout_percent}): "
                          "raise tasks.heldout_percent or use a bigger set")
  except RunInputError:
    for path in set(glob.glob(os.path.join(cfg.workdir, "tasks_*.json"))) - frozen:
      os.remove(path)
    raise
  return pool, heldout


def check_budgets(cfg: RunConfig, tokenizer, tasks) -> None:
  """Raises `RunInputError` when the oracle of a finite set's `tasks` (its gold patch written through the agent's
  tools) does not fit `harness.max_turn_tokens` or one `harness.context_budget`, naming the values that fit
  (`rollout.evaluation.budget.fit_budget`, as evaluation sizes its budgets). Procedural tasks are sized by their
  config (a multi-segment level needs its summaries by design)."""
  if cfg.tasks.kind == "procedural":
    return
  h = cfg.harness
  fitted = budget.fit_budget(tasks, tokenizer, h)
  if (fitted.max_turn_tokens, fitted.context_budget) == (h.max_turn_tokens, h.context_budget):
    return
  flags = (f"--config.harness.max_turn_tokens={fitted.max_turn_tokens} "
           f"--config.harness.summary_max_tokens={fitted.max_turn_tokens} "
           f"--config.harness.context_budget={fitted.context_budget}")
  positions = bucket(fitted.context_budget - fitted.max_turn_tokens, 1) + bucket(fitted.max_turn_tokens, 1)
  if positions > cfg.model.max_position_embeddings:   # as `RunConfig` checks it: padded prompt + padded turn
    flags += f" --config.model.max_position_embeddings={positions}"
  raise RunInputError(f"the oracle of the {cfg.tasks.kind!r} tasks does not fit the harness budgets "
                      f"(harness.max_turn_tokens={h.max_turn_tokens}, harness.context_budget={h.context_budget}; "
                      f"its gold patches need {fitted.max_turn_tokens} and {fitted.context_budget}): rerun with "
                      f"{flags}")
