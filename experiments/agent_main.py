r"""Runs policies through the agent harness on procedural tasks and prints transcripts, rewards and breakdowns.

  python experiments/agent_main.py --config=experiments/configs/agent.py:colab
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).", lock_config=True)


def _random_model_engine(c, tok):
  """The embedded JAX engine serving a randomly initialised model of `c.model` (vocab sized to the tokenizer)."""
  import jax

  from composer_jax import configs, model
  from composer_jax.sampling.engine import EngineConfig, JaxEngine
  from composer_jax.train import tokenizer as tokenizer_lib
  from experiments.configs import model as model_configs
  d = model_configs.get_config(c.model).to_dict()
  d["vocab_size"] = tokenizer_lib.padded_vocab_size(tok)
  cfg = configs.from_dict(model.ModelConfig, d)
  return JaxEngine(model.init(jax.random.key(c.seed), cfg), cfg, EngineConfig(seed=c.seed))


def main(argv):
  del argv
  from composer_jax.train import tokenizer as tokenizer_lib
  from rollout import chat_format, harness
  from rollout.engines import protocol, scripted
  from rollout.evaluation import runner
  from rollout.rewards import RewardConfig
  from rollout.tasks import procedural
  from rollout.tasks.environment import EnvironmentCache
  from rollout.tools import ToolConfig
  from rollout.workspace import make_factory

  c = _CONFIG.value
  tasks = procedural.generate(c.tasks.n, seed=c.tasks.seed, split=c.tasks.split, level=c.tasks.level)
  h = c.harness
  system = harness.SHORT_SYSTEM_PROMPT if h.short_system_prompt else harness.SYSTEM_PROMPT
  if c.tokenizer.dir:
    tok = tokenizer_lib.load_tokenizer(c.tokenizer.dir)
  else:  # a small BPE fitted to training-split projects and oracle transcripts (never the held-out ones)
    fit = procedural.generate(c.tokenizer.train_tasks, seed=c.seed + 1, level=c.tasks.level)
    texts = [f for t in fit for f in t.environment.files.values()] + [system, harness.SUMMARY_PROMPT]
    texts += [chat_format.render([{"role": "assistant", **m} for m in t.metadata["oracle"]]) for t in fit]
    tok = tokenizer_lib.train_tokenizer(texts, tokenizer_lib.TokenizerConfig(vocab_size=c.tokenizer.vocab_size))
  cfg = harness.HarnessConfig(
    system_prompt=system, context_budget=h.context_budget, max_turn_tokens=h.max_turn_tokens,
    observation_reserve=h.observation_reserve, max_turns=h.max_turns, max_segments=h.max_segments,
    summary_max_tokens=h.summary_max_tokens, sampling=protocol.SamplingParams(temperature=h.temperature),
    tools=ToolConfig(max_output_chars=h.max_output_chars), rewards=RewardConfig(**c.rewards), seed=c.seed)
  available = {
    "oracle": lambda: scripted.ScriptedEngine(tok, scripted.oracle_policy(tasks)),
    "noop": lambda: scripted.ScriptedEngine(tok, scripted.noop_policy),
    "random": lambda: scripted.RandomEngine(tok.get_vocab_size(), seed=c.seed),   # uniform random tokens
    "model": lambda: _random_model_engine(c, tok),   # a randomly initialised MoE through the embedded JAX engine
  }
  names = c.policies.split("+")
  unknown = [n for n in names if n not in available]
  if unknown:
    raise ValueError(f"unknown policies {unknown}; valid: {sorted(available)}")
  factory = make_factory(c.backend)
  try:
    envs = EnvironmentCache(factory)
    for n in names:
      runner.evaluate_policy(n, available[n](), tok, tasks, envs, cfg, transcripts=c.n_transcripts)
  finally:
    factory.close()


if __name__ == "__main__":
  app.run(main)
