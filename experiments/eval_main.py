r"""Evaluates policies (scripted baselines, a JAX checkpoint, an SGLang endpoint) on a task set; see
experiments/configs/eval.py for commands, variants and expected results.

  python experiments/eval_main.py --config=experiments/configs/eval.py:procedural --config.out=runs/eval_proc
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).", lock_config=True)
POLICIES = ("oracle", "noop", "random", "checkpoint", "sglang")


def _baseline_tokenizer(c, system: str):
  """A small BPE fitted to training-split procedural projects and oracle transcripts (never held-out tasks)."""
  from composer_jax.train import tokenizer as tokenizer_lib
  from rollout import chat_format, harness
  from rollout.tasks import procedural
  fit = [t for lv in c.set.levels for t in procedural.generate(c.tokenizer.train_tasks, seed=c.seed + 1, split="train",
                                                                   level=lv)]
  texts = [f for t in fit for f in t.environment.files.values()] + [system, harness.SUMMARY_PROMPT]
  texts += [chat_format.render([{"role": "assistant", **m} for m in t.metadata["oracle"]]) for t in fit]
  return tokenizer_lib.train_tokenizer(texts, tokenizer_lib.TokenizerConfig(vocab_size=c.tokenizer.vocab_size))


def _policy_names(c) -> list[str]:
  """The requested policy names, checked before anything slow (mining) runs."""
  names = [n for n in c.policies.split("+") if n]
  unknown = [n for n in names if n not in POLICIES]
  if unknown or not names:
    raise app.UsageError(f"unknown policies {unknown or names} in policies={c.policies!r}; valid: {POLICIES}")
  if "checkpoint" in names and not c.checkpoint.workdir:
    raise app.UsageError("policy 'checkpoint' needs checkpoint=<workdir>[:<workdir>...] (params/ or weights/, and "
                         "tokenizer/)")
  if "sglang" in names and not c.sglang_url:
    raise app.UsageError("policy 'sglang' needs sglang_url=http://host:port")
  return names


def _policies(c, names: list[str], system: str) -> dict:
  from rollout.evaluation import policies, suite
  out, tok = {}, None
  if "checkpoint" in names:
    from composer_jax import configs, eval_policies
    from composer_jax.model.config import ModelConfig
    from experiments.configs import model as model_configs
    model_cfg = configs.from_dict(ModelConfig, model_configs.get_config(c.checkpoint.model).to_dict())
    for w in (w for w in c.checkpoint.workdir.split(":") if w):  # checkpoints of one model share a tokenizer
      engine, tok, active = eval_policies.checkpoint_policy(w, model_cfg)
      label = f"ckpt:{os.path.basename(os.path.normpath(w))}@v{engine.policy_version}"
      out[label] = suite.Policy(lambda tasks, engine=engine: engine, tok, active)
  tok = tok or _baseline_tokenizer(c, system)  # baselines speak the checkpoint's tokenizer when there is one
  for n in names:
    if n in policies.BASELINES:
      out[n] = suite.Policy(lambda tasks, n=n: policies.baseline(n, tok, tasks, seed=c.seed), tok, 0)
    elif n == "sglang":
      out["sglang"] = suite.Policy(lambda tasks: policies.SGLangEndpointEngine(c.sglang_url), tok, 0)
  return out


def _harness_config(c):
  from rollout import harness
  from rollout.engines import protocol
  from rollout.tools import ToolConfig
  h = c.harness
  prompts = {"full": harness.SYSTEM_PROMPT, "short": harness.SHORT_SYSTEM_PROMPT}
  if h.system_prompt not in prompts:
    raise app.UsageError(f"harness.system_prompt={h.system_prompt!r}; valid: {sorted(prompts)}")
  return harness.HarnessConfig(
    system_prompt=prompts[h.system_prompt], context_budget=h.context_budget, max_turn_tokens=h.max_turn_tokens,
    observation_reserve=h.observation_reserve, max_turns=h.max_turns, max_segments=h.max_segments,
    summary_max_tokens=h.summary_max_tokens, sampling=protocol.SamplingParams(temperature=h.temperature),
    tools=ToolConfig(max_output_chars=h.max_output_chars), seed=c.seed, grade_workers=h.grade_workers)


def _set_spec(c):
  from rollout.tasks import miner, registry
  set_cfg = c.set.to_dict()
  set_cfg["miner"] = miner.MinerConfig(**{k: v for k, v in set_cfg["miner"].items() if v})
  try:
    return registry.SetSpec(**set_cfg)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def _build_set(c, spec, envs) -> None:
  from rollout.evaluation import builder
  from rollout.tasks import setfile
  b = c.builder
  built, excluded = builder.build_set(
    spec.repos, envs, builder.SetFilters(b.min_files, b.min_lines, b.max_prompt_chars), spec.miner,
    name=os.path.splitext(os.path.basename(b.path))[0], version=b.version)
  setfile.write_set(b.path, built)
  for what, why in excluded:
    print(f"excluded {what}: {why}")
  print(f"wrote {len(built['tasks'])} tasks to {b.path} (sha256 {built['sha256'][:12]})")


def main(argv):
  del argv
  c = _CONFIG.value
  if c is None:
    raise app.UsageError("--config is required, e.g. --config=experiments/configs/eval.py:procedural "
                         "(variants: procedural, mined, swe, file; see experiments/configs/eval.py)")
  from rollout.evaluation import budget, runner, suite
  from rollout.tasks import registry
  from rollout.tasks.environment import EnvironmentCache
  from rollout.workspace import make_factory

  names = _policy_names(c)
  spec = _set_spec(c)
  hcfg = _harness_config(c)
  factory = make_factory(c.backend)
  try:
    envs = EnvironmentCache(factory)
    if c.builder.path:
      _build_set(c, spec, envs)
      return
    try:
      tasks = registry.load_tasks(spec, envs)
    except (ValueError, FileNotFoundError) as e:
      raise app.UsageError(f"cannot load the {spec.kind!r} task set: {e}") from None
    pols = _policies(c, names, hcfg.system_prompt)
    if c.harness.auto_budget:
      fitted = budget.fit_budget(tasks, next(iter(pols.values())).tokenizer, hcfg)
      if fitted != hcfg:
        print(f"budget from the set's gold patches: max_turn_tokens {hcfg.max_turn_tokens} -> "
              f"{fitted.max_turn_tokens}, context_budget {hcfg.context_budget} -> {fitted.context_budget}")
      hcfg = fitted
    out = suite.evaluate({spec.name: tasks}, pols, envs, hcfg, c.out,
                         runner.RunConfig(samples=c.samples, chunk_tasks=c.chunk_tasks), corpus=c.corpus,
                         exclude_contaminated=not c.keep_contaminated, gold_runs=c.gold_runs)
    for name, r in out.items():
      print(f"[{name}] Pareto front: {r['pareto_front']}; plot: {os.path.join(c.out, name, 'pareto.png')}")
  finally:
    factory.close()


if __name__ == "__main__":
  app.run(main)
