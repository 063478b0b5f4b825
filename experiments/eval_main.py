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


def _baseline_tokenizer(c, spec, system: str):
  """A small BPE fitted to training-split procedural tasks of the set's levels (never evaluated tasks)."""
  from composer_jax.rl import warmstart
  from composer_jax.train import tokenizer as tokenizer_lib
  from rollout.tasks import registry
  return warmstart.fit_tokenizer_to_source(registry.SetSpec("procedural", levels=spec.levels), None, system,
                                           tokenizer_lib.TokenizerConfig(vocab_size=c.tokenizer.vocab_size),
                                           c.tokenizer.train_tasks, c.seed + 1)


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


def _policies(c, names: list[str], spec, system: str) -> dict:
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
  tok = tok or _baseline_tokenizer(c, spec, system)  # baselines speak the checkpoint's tokenizer when there is one
  for n in names:
    if n in policies.BASELINES:
      out[n] = suite.Policy(lambda tasks, n=n: policies.baseline(n, tok, tasks, seed=c.seed), tok, 0)
    elif n == "sglang":
      out["sglang"] = suite.Policy(lambda tasks: policies.SGLangEndpointEngine(c.sglang_url), tok, 0)
  return out


def _harness_config(c):
  from composer_jax import configs
  from rollout.harness import HarnessConfig
  try:
    return configs.from_dict(HarnessConfig, c.harness, "harness.")
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def _set_spec(c):
  from composer_jax import configs
  from rollout.tasks import registry
  try:
    return configs.from_dict(registry.SetSpec, c.set, "set.")
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
  from composer_jax.compile_cache import enable_compilation_cache
  enable_compilation_cache()   # a second run skips its compiles
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
    pols = _policies(c, names, spec, hcfg.system_prompt)
    if c.auto_budget:
      fitted = budget.fit_budget(tasks, next(iter(pols.values())).tokenizer, hcfg)
      if fitted != hcfg:
        print(f"budget from the set's gold patches: max_turn_tokens {hcfg.max_turn_tokens} -> "
              f"{fitted.max_turn_tokens}, context_budget {hcfg.context_budget} -> {fitted.context_budget}")
      hcfg = fitted
    out = suite.evaluate({spec.name: tasks}, pols, envs, hcfg, c.out,
                         runner.SampleConfig(samples=c.samples, chunk_tasks=c.chunk_tasks), corpus=c.corpus,
                         exclude_contaminated=not c.keep_contaminated, gold_runs=c.gold_runs)
    for name, r in out.items():
      print(f"[{name}] Pareto front: {r['pareto_front']}; plot: {os.path.join(c.out, name, 'pareto.png')}")
  finally:
    factory.close()


if __name__ == "__main__":
  app.run(main)
