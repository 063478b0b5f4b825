"""Policies through the agent harness on a task source: the demo behind `experiments/agent_main.py`.

Scripted baselines (`oracle`, `noop`, `random`: `rollout.evaluation.policies`) and `model` (a randomly initialised
MoE of `model`'s shape, served by the embedded JAX engine) run on the tasks of `tasks` through the one evaluation
runner (`rollout.evaluation.runner.evaluate_policy`), which logs transcripts and one summary line per policy. The
oracle must score 1 and the no-op 0: a validity check of the tasks, the tools and the grader.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from composer_jax.model.config import ModelConfig
from composer_jax.train import tokenizer as tokenizer_lib
from rollout.evaluation import policies, runner
from rollout.harness import HarnessConfig
from rollout.tasks import registry
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import make_factory

POLICIES = (*policies.BASELINES, "model")


@dataclasses.dataclass(frozen=True)
class TokenizerSource:
  """A saved tokenizer (`dir`), or one fitted to `train_tasks` tasks of the source's train side."""
  dir: str = ""
  train_tasks: int = 200
  fit: tokenizer_lib.TokenizerConfig = tokenizer_lib.TokenizerConfig(vocab_size=1024)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Which policies run on which tasks in which harness (nested as `experiments/configs/agent.py`)."""
  tasks: registry.SetSpec
  harness: HarnessConfig = HarnessConfig()
  model: ModelConfig = ModelConfig()      # shape of `model` (its vocab is sized to the tokenizer)
  policies: tuple[str, ...] = ("oracle", "noop", "model")
  tokenizer: TokenizerSource = TokenizerSource()
  workspaces: str = "sandbox"             # workspaces: 'sandbox' (bubblewrap) or 'local'
  seed: int = 0
  transcripts: int = 1

  def __post_init__(self):
    unknown = [p for p in self.policies if p not in POLICIES]
    if unknown or not self.policies:
      raise ValueError(f"unknown policies {unknown or list(self.policies)}; valid: {POLICIES}")


def _random_model_engine(cfg: DemoConfig, tok):
  import jax

  from composer_jax import model
  from composer_jax.sampling.engine import EngineConfig, JaxEngine
  mcfg = dataclasses.replace(cfg.model, vocab_size=tokenizer_lib.padded_vocab_size(tok))
  return JaxEngine(model.init(jax.random.key(cfg.seed), mcfg), mcfg, EngineConfig(seed=cfg.seed))


def run(cfg: DemoConfig, log: Callable[[str], None] = print) -> dict[str, dict]:
  """Runs every policy of `cfg` on its tasks; returns policy -> the runner's summary (pass@1, reward, ...)."""
  from composer_jax.rl import setup
  factory = make_factory(cfg.workspaces)
  try:
    envs = EnvironmentCache(factory)
    tasks = registry.load_tasks(cfg.tasks, envs, log)
    if cfg.tokenizer.dir:
      tok = tokenizer_lib.load_tokenizer(cfg.tokenizer.dir)
    else:
      tok = setup.fit_tokenizer_to_source(cfg.tasks, envs, cfg.harness.system_prompt, cfg.tokenizer.fit,
                                              cfg.tokenizer.train_tasks, cfg.seed + 1)
    out = {}
    for name in cfg.policies:
      engine = _random_model_engine(cfg, tok) if name == "model" else policies.baseline(name, tok, tasks, cfg.seed)
      out[name] = runner.evaluate_policy(name, engine, tok, tasks, envs, cfg.harness, transcripts=cfg.transcripts,
                                         log=log)
    return out
  finally:
    factory.close()
