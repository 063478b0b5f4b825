"""Policies x one task set through the evaluation suite: the run behind `experiments/eval_main.py`.

Scripted baselines (`oracle`, `noop`, `random`: `rollout.evaluation.policies`), JAX checkpoints (`checkpoint`: one
or more workdirs, read by `composer_jax.eval_policies`, served by the embedded engine) and an SGLang endpoint
(`sglang`) run on the tasks of `set` through `rollout.evaluation.suite.evaluate` (k samples, gold validation,
contamination guard, cost, Pareto plot; re-running with the same `out` resumes). With `builder.path` set, the run
instead mines `set.repos` into a frozen, versioned set file (`rollout.evaluation.builder`).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from composer_jax.agent_demo import TokenizerSource
from composer_jax.model.config import ModelConfig
from rollout.evaluation import budget, builder, policies, runner, suite
from rollout.harness import HarnessConfig
from rollout.tasks import registry, setfile
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import make_factory

POLICIES = (*policies.BASELINES, "checkpoint", "sglang")
Log = Callable[[str], None]


class EvalInputError(ValueError):
  """Bad input found only once the run looks at it (a task set that cannot load): the user's to fix."""


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
  """JAX checkpoints evaluated as policies: `workdir` is one or more workdirs joined by ':' (each an LM-stage
  `params/` or an RL-run `weights/`, with `tokenizer/`), all of the shape `model`."""
  workdir: str = ""
  model: ModelConfig = ModelConfig()


@dataclasses.dataclass(frozen=True)
class SetBuild:
  """With `path` set: mine the set's repos and write a frozen set file there (version `version`) instead of
  evaluating; tasks must pass the filters (`builder.SetFilters`)."""
  path: str = ""
  version: str = "1"
  min_files: int = 1
  min_lines: int = 1
  max_prompt_chars: int = 1000


@dataclasses.dataclass(frozen=True)
class EvalRunConfig:
  """Which policies run on which task set in which harness (nested as `experiments/configs/eval.py`)."""
  set: registry.SetSpec
  policies: tuple[str, ...] = ("oracle", "noop", "random")
  samples: int = 2
  chunk_tasks: int = 8
  corpus: str = ""                # pretraining corpus for the contamination guard; "" = off
  keep_contaminated: bool = False
  checkpoint: CheckpointSource = CheckpointSource()
  sglang_url: str = ""
  workspaces: str = "sandbox"     # workspaces: 'sandbox' (bubblewrap) or 'local'
  out: str = "runs/eval"
  seed: int = 0
  gold_runs: int = 2              # gold validation runs each side this often (>= 2: a flaky task is invalid)
  builder: SetBuild = SetBuild()
  tokenizer: TokenizerSource = TokenizerSource()  # the baselines' tokenizer when no checkpoint brings one
  harness: HarnessConfig = HarnessConfig()
  auto_budget: bool = False       # raise the harness budgets to what the set's gold patches need

  def __post_init__(self):
    """Checks the policy names before anything slow (mining) runs."""
    unknown = [n for n in self.policies if n not in POLICIES]
    if unknown or not self.policies:
      raise ValueError(f"unknown policies {unknown or list(self.policies)} in policies={'+'.join(self.policies)!r}; "
                       f"valid: {POLICIES}")
    if "checkpoint" in self.policies and not self.checkpoint.workdir:
      raise ValueError("policy 'checkpoint' needs checkpoint=<workdir>[:<workdir>...] (params/ or weights/, and "
                       "tokenizer/)")
    if "sglang" in self.policies and not self.sglang_url:
      raise ValueError("policy 'sglang' needs sglang_url=http://host:port")


def _baseline_tokenizer(cfg: EvalRunConfig):
  """A saved tokenizer, or a small BPE fitted to training-split procedural tasks of the set's levels (never
  evaluated tasks)."""
  from composer_jax.rl import setup
  from composer_jax.train import tokenizer as tokenizer_lib
  if cfg.tokenizer.dir:
    return tokenizer_lib.load_tokenizer(cfg.tokenizer.dir)
  return setup.fit_tokenizer_to_source(registry.SetSpec("procedural", levels=cfg.set.levels), None,
                                           cfg.harness.system_prompt, cfg.tokenizer.fit, cfg.tokenizer.train_tasks,
                                           cfg.seed + 1)


def _policies(cfg: EvalRunConfig) -> dict[str, suite.Policy]:
  """Label -> Policy: one per checkpoint workdir, then the baselines and the endpoint."""
  out, tok = {}, None
  if "checkpoint" in cfg.policies:
    from composer_jax import eval_policies
    for w in (w for w in cfg.checkpoint.workdir.split(":") if w):  # checkpoints of one model share a tokenizer
      engine, tok, active = eval_policies.checkpoint_policy(w, cfg.checkpoint.model)
      label = f"ckpt:{os.path.basename(os.path.normpath(w))}@v{engine.policy_version}"
      out[label] = suite.Policy(lambda tasks, engine=engine: engine, tok, active)
  tok = tok or _baseline_tokenizer(cfg)  # baselines speak the checkpoint's tokenizer when there is one
  for n in cfg.policies:
    if n in policies.BASELINES:
      out[n] = suite.Policy(lambda tasks, n=n: policies.baseline(n, tok, tasks, seed=cfg.seed), tok, 0)
    elif n == "sglang":
      out["sglang"] = suite.Policy(lambda tasks: policies.SGLangEndpointEngine(cfg.sglang_url), tok, 0)
  return out


def build_set(cfg: EvalRunConfig, envs: EnvironmentCache, log: Log = print) -> dict:
  """Mines `cfg.set.repos` into the frozen set file `cfg.builder.path`; returns the written set."""
  b = cfg.builder
  built, excluded = builder.build_set(
    cfg.set.repos, envs, builder.SetFilters(b.min_files, b.min_lines, b.max_prompt_chars), cfg.set.miner,
    name=os.path.splitext(os.path.basename(b.path))[0], version=b.version)
  for what, why in excluded:
    log(f"excluded {what}: {why}")
  if not built["tasks"]:
    raise EvalInputError(f"no mined task passed the filters (min_files={b.min_files}, min_lines={b.min_lines}, "
                         f"max_prompt_chars={b.max_prompt_chars}; {len(excluded)} excluded): {b.path} not written")
  setfile.write_set(b.path, built)
  log(f"wrote {len(built['tasks'])} tasks to {b.path} (sha256 {built['sha256'][:12]})")
  return built


def run(cfg: EvalRunConfig, log: Log = print) -> dict[str, dict]:
  """Evaluates every policy of `cfg` on its set (or builds the set file); returns set name -> the suite's result
  (empty when a set file was built). Raises `EvalInputError` when the set cannot load."""
  factory = make_factory(cfg.workspaces)
  try:
    envs = EnvironmentCache(factory)
    if cfg.builder.path:
      build_set(cfg, envs, log)
      return {}
    try:
      tasks = registry.load_tasks(cfg.set, envs)
    except (ValueError, FileNotFoundError) as e:
      raise EvalInputError(f"cannot load the {cfg.set.kind!r} task set: {e}") from None
    pols = _policies(cfg)
    hcfg = cfg.harness
    if cfg.auto_budget:
      fitted = budget.fit_budget(tasks, next(iter(pols.values())).tokenizer, hcfg)
      if fitted != hcfg:
        log(f"budget from the set's gold patches: max_turn_tokens {hcfg.max_turn_tokens} -> "
            f"{fitted.max_turn_tokens}, context_budget {hcfg.context_budget} -> {fitted.context_budget}")
      hcfg = fitted
    out = suite.evaluate({cfg.set.name: tasks}, pols, envs, hcfg, cfg.out,
                         runner.SampleConfig(samples=cfg.samples, chunk_tasks=cfg.chunk_tasks), corpus=cfg.corpus,
                         exclude_contaminated=not cfg.keep_contaminated, gold_runs=cfg.gold_runs, log=log)
    for name, r in out.items():
      log(f"[{name}] Pareto front: {r['pareto_front']}; plot: {os.path.join(cfg.out, name, 'pareto.png')}")
    return out
  finally:
    factory.close()
