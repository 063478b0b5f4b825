"""What an RL run builds once from its `RunConfig` and every phase shares, checked before it spends time.

`open_run(cfg, mesh)` yields the run's `Run`: its workspaces (one `EnvironmentCache`, closed when the block ends),
the training pool, the held-out and dev tasks, the tokenizer and the trainer's mesh and rules (built once in
`rl.workdir.claim`); the phases take it with the config section they read (the warm start `cfg.sft_plan`, the
trainer its built RL step), not the whole `RunConfig`. Building it checks the run's input, so bad input is a
`RunInputError` naming the field to change, raised before the minutes of demonstrations, SFT and RL that would
otherwise end in it: both task sides load and are non-empty, and the oracle of a finite set fits the budgets.

Tasks come from the one task-source registry (`rollout.tasks.registry`): the training pool is `cfg.tasks` (its
'train' side), held-out tasks are the same source's 'heldout' side. A pool of a finite source (mined, swe, file) is
loaded once and frozen into the workdir (`tasks_<split>_<n>.json`), so worker processes and restarts train on
exactly the tasks the trainer saw, and nothing is mined twice.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
from collections.abc import Iterator, Sequence

from jax.sharding import Mesh

from composer_jax.configs import to_dict
from composer_jax.parallel.rules import ShardingRules
from composer_jax.rl.config import RunConfig, RunInputError
from composer_jax.sampling.decode import bucket
from composer_jax.train import tokenizer as tokenizer_lib
from rollout import chat_format, harness
from rollout.evaluation import budget, policies
from rollout.tasks import miner, registry
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task
from rollout.workspace import make_factory

# What a task source raises on bad input: a missing or malformed file, a path that is not a repository.
_LOAD_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, miner.MiningError)
DEV_TASKS = 32   # held-out tasks whose oracle transcripts measure the SFT dev loss


@dataclasses.dataclass
class Run:
  """The pieces of one RL run, built once (`open_run`) and handed to every phase, with where the run writes and
  whether it shows progress bars."""
  tokenizer: object
  pool: list[Task]          # the training tasks
  heldout: list[Task]       # the held-out tasks (`eval.tasks` of them)
  dev: list[Task]           # up to `DEV_TASKS` held-out tasks: the SFT dev loss (none: a small set has no spare)
  envs: EnvironmentCache    # the tasks' workspaces
  workdir: str
  progress_bar: bool
  mesh: Mesh | None         # the trainer's devices, where the warm start and the RL step train (a worker: none)
  rules: ShardingRules      # the logical rules that place the trainer's arrays on `mesh` (`cfg.mesh.rules()`)


@contextlib.contextmanager
def open_run(cfg: RunConfig, mesh: Mesh | None = None) -> Iterator[Run]:
  """The run's `Run` on `mesh` (the trainer's; a rollout worker trains nothing and has none), its workspaces
  closed when the block ends; raises `RunInputError` on bad input first."""
  envs = EnvironmentCache(make_factory(cfg.rollout.workspaces))
  try:
    pool, heldout, dev = _checked_tasks(cfg, envs)
    tok = run_tokenizer(cfg, pool)   # checked against the budgets
    yield Run(tok, pool, heldout, dev, envs, cfg.workdir, cfg.progress_bar, mesh, cfg.mesh.rules())
  finally:
    envs.factory.close()


def _checked_tasks(cfg: RunConfig, envs: EnvironmentCache) -> tuple[list[Task], list[Task], list[Task]]:
  """The training pool, the held-out tasks and the dev tasks; raises `RunInputError` when a side cannot load or
  is empty, leaving no frozen pool behind (a rerun with the set or `tasks.heldout_percent` fixed must not find the
  refused one frozen)."""
  frozen = set(glob.glob(os.path.join(cfg.workdir, "tasks_*.json")))
  try:
    try:
      pool = train_pool(cfg, envs)
      heldout = heldout_tasks(cfg, envs)
      dev = heldout_tasks(cfg, envs, DEV_TASKS)
    except _LOAD_ERRORS as e:
      raise RunInputError(f"cannot load the {cfg.tasks.kind!r} task source: {e}") from None
    if not pool:
      raise RunInputError(f"the {cfg.tasks.kind!r} task source has no training tasks at tasks.heldout_percent="
                          f"{cfg.tasks.heldout_percent} (a finite set's sides follow its tasks' gold patches): lower "
                          "tasks.heldout_percent or use a bigger set")
    if not heldout:
      raise RunInputError(f"the {cfg.tasks.kind!r} task source has no held-out tasks to evaluate on "
                          f"({len(pool)} training tasks at tasks.heldout_percent={cfg.tasks.heldout_percent}): "
                          "raise tasks.heldout_percent or use a bigger set")
  except RunInputError:
    for path in set(glob.glob(os.path.join(cfg.workdir, "tasks_*.json"))) - frozen:
      os.remove(path)
    raise
  return pool, heldout, dev


def train_pool(cfg: RunConfig, envs: EnvironmentCache) -> list[Task]:
  return _load(cfg, cfg.tasks, envs)


def heldout_spec(cfg: RunConfig, n: int | None = None) -> registry.SetSpec:
  """The held-out side of the run's task source (procedural: another seed too; at most `n` or `eval.tasks`)."""
  return dataclasses.replace(cfg.tasks, split="heldout", seed=cfg.tasks.seed + 1, n=n or cfg.eval.tasks)


def heldout_tasks(cfg: RunConfig, envs: EnvironmentCache, n: int | None = None) -> list[Task]:
  return _load(cfg, heldout_spec(cfg, n), envs)


def _load(cfg: RunConfig, spec: registry.SetSpec, envs: EnvironmentCache, log=print) -> list[Task]:
  if spec.kind == "procedural":   # generated, cheap and deterministic
    return registry.load_tasks(spec, None, log)
  path = os.path.join(cfg.workdir, f"tasks_{spec.split}_{spec.n}.json")
  if os.path.exists(path):
    with open(path) as f:
      frozen = json.load(f)
    now = json.loads(json.dumps(to_dict(spec)))   # as JSON stores it (tuples become lists)
    if frozen["spec"] != now:
      diff = {k: (v, now.get(k)) for k, v in frozen["spec"].items() if now.get(k) != v}
      raise ValueError(f"{path} froze the tasks of another task source {diff} (frozen, now): use a new workdir")
    return [Task.from_dict(d) for d in frozen["tasks"]]
  tasks = registry.load_tasks(spec, envs, log)
  os.makedirs(cfg.workdir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump({"spec": to_dict(spec), "tasks": [t.to_dict() for t in tasks]}, f)
  os.replace(path + ".tmp", path)
  return tasks


def of_levels(tasks: list[Task], levels) -> list[Task]:
  """The tasks of those procedural levels (`metadata['level']`), in order."""
  return [t for t in tasks if t.metadata.get("level") in levels]


def fit_tokenizer(tasks: Sequence, system_prompt: str, vocab_size: int | tokenizer_lib.TokenizerConfig):
  """A BPE fitted to training-split project files, prompts and oracle transcripts (the one tokenizer fitting)."""
  tasks = policies.with_oracle(tasks)
  texts = [f for t in tasks for f in t.environment.files.values()] + [system_prompt, harness.SUMMARY_PROMPT]
  texts += [t.prompt for t in tasks]
  texts += [chat_format.render([{"role": "assistant", **m} for m in t.metadata["oracle"]]) for t in tasks]
  cfg = vocab_size if isinstance(vocab_size, tokenizer_lib.TokenizerConfig) else tokenizer_lib.TokenizerConfig(
      vocab_size=vocab_size)
  return tokenizer_lib.train_tokenizer(texts, cfg)


def fit_tokenizer_to_source(spec, envs, system_prompt: str, cfg: tokenizer_lib.TokenizerConfig, n: int, seed: int):
  """`fit_tokenizer` on `n` tasks of the *train* side of `spec`'s source (never held-out tasks; procedural tasks
  from generator seed `seed`), for baselines and demos that have no trained model's tokenizer."""
  fit = dataclasses.replace(spec, split="train", n=n, seed=seed)
  return fit_tokenizer(registry.load_tasks(fit, envs, log=lambda s: None), system_prompt, cfg)


def run_tokenizer(cfg: RunConfig, pool: list[Task]):
  """The run's tokenizer: already in the workdir, else the init checkpoint's, else fitted to training tasks (with a
  curriculum, to those of its first levels: measured, a BPE fitted to the mix left the level-2 start at 17-22%
  greedy where one fitted to level 1 reached 56-78%, experiments/results/curriculum.md).

  Checked against the harness budgets, which are in its tokens: raises `RunInputError` when the oracle of a finite
  set's `pool` (its gold patch written through the agent's tools) does not fit `harness.max_turn_tokens` or one
  `harness.context_budget`, naming the values that fit (`rollout.evaluation.budget.fit_budget`, as evaluation sizes
  its budgets). Procedural tasks are sized by their config (a multi-segment level needs its summaries by design)."""
  tok_dir = tokenizer_dir(cfg.workdir)
  if os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
    source = tok_dir
  else:
    source = os.path.join(cfg.sft.init_checkpoint, "tokenizer") if cfg.sft.init_checkpoint else None
  if source is None:
    fit = pool[:max(cfg.sft.tasks, 256)]
    if cfg.sft.curriculum_levels:
      fit = of_levels(fit, cfg.sft.curriculum_levels)
    tok = fit_tokenizer(fit, cfg.harness.system_prompt, cfg.tokenizer)
  else:
    tok = tokenizer_lib.load_tokenizer(source)
  if source != tok_dir:
    tokenizer_lib.save_tokenizer(tok, tok_dir)
  if cfg.tasks.kind == "procedural":
    return tok
  h = cfg.harness
  fitted = budget.fit_budget(pool, tok, h)
  if (fitted.max_turn_tokens, fitted.context_budget) == (h.max_turn_tokens, h.context_budget):
    return tok
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


def queue_url(workdir: str) -> str:
  return f"file://{os.path.join(os.path.abspath(workdir), 'queue')}"


def tokenizer_dir(workdir: str) -> str:
  return os.path.join(workdir, "tokenizer")
