r"""CursorBench-style evaluation: policies x task sets, k samples, gold validation, cost, set statistics, Pareto plot.

  python experiments/eval_main.py --config=experiments/configs/eval.py:procedural --config.out=runs/eval_proc
  python experiments/eval_main.py --config=experiments/configs/eval.py:mined,repos=/src/a:/src/b
  python experiments/eval_main.py --config=experiments/configs/eval.py:file,set_file=sets/mine_v1.json
  python experiments/eval_main.py --config=experiments/configs/eval.py:swe,jsonl=tasks.jsonl,repos_dir=/src
  python experiments/eval_main.py --config=experiments/configs/eval.py:procedural,policies=oracle+noop+checkpoint,\
checkpoint=runs/rl_colab,model=rl_colab,harness=rl_colab
  python experiments/eval_main.py --config=experiments/configs/eval.py:mined,repos=/src/a,build_set=sets/a_v1.json

Variants name the task source (`rollout/tasks/registry.py`): `procedural` (held-out procedural tasks, `levels=1` or
a mix `levels=1+2+3`, `n_tasks=`), `mined` (mine local git repositories now, `repos=` colon-separated), `swe`
(SWE-bench-style JSONL against local clones), `file` (a frozen set written by the set builder). `build_set=PATH` mines
`repos` with the filters (`min_files`, `min_lines`, `max_prompt_chars`) and writes a frozen, versioned set file
instead of evaluating.

Budgets: for repository sets (mined, swe, file) `auto_budget` raises `max_turn_tokens` and
`context_budget` to what the set's gold patches need in the policy's tokenizer (`rollout/evaluation/budget.py`: a
real patch is 1,100-2,200 tokens with the colab BPE at ~1.3 characters per token; a big-vocabulary tokenizer needs
2-3x fewer); tasks whose oracle still does not fit are flagged. `harness.grade_workers` sets how many episodes are
graded at once.

An RL-run checkpoint is evaluated by default in the agent loop it was trained in (the harness its run_config.pkl
stores); `harness=default` runs the loop above instead. `harness=rl` runs the agent loop with the settings the
default RL run's checkpoints (`make run`, `rl.py:recipe_best`)
were trained in (short system prompt, 496-token budget, up to 4 segments with the short summary prompt, 10 turns;
evaluate with `levels=1+2+3,model=rl_colab`); `harness=rl_colab` those of `rl.py:colab` (`make colab`: 320-token
budget, 4 turns, one segment).
Policies (`policies=a+b`): `oracle`, `noop`, `random` (scripted baselines, cost 0), `checkpoint` (an LM-stage workdir
`checkpoint=` an LM-stage workdir (params/) or an RL-run workdir (weights/latest.json), both with tokenizer/;
several joined by ':' appear side by side on the plot; `model=` their model-config variant, by default the model an
RL run stored with its checkpoint (run_config.pkl), else colab; embedded JAX engine),
`sglang` (`sglang_url=`). Re-running with the same `out` resumes: finished tasks are not re-run, and a bigger
`n_tasks` (same seed and levels) runs only the new tasks.

Expected (procedural, 8 level-1 held-out tasks, k=2, oracle+noop+random, sandboxes): ~20-40 s on 2 busy cores;
oracle pass@1 = 1.0, no-op 0.0, random 0.0; out/procedural/{summary.txt,pareto.png}, out/set_stats.txt.
"""
import dataclasses
import os

import ml_collections

from experiments.configs import common
from experiments.configs import model as model_configs
from experiments.configs import rl as rl_configs
from rollout.tasks import miner

# harness presets: the rl.py variant whose agent loop each one copies, and the loop's fields it copies (those the
# variant sets; rl.py:colab keeps the harness's default summary_prompt)
RL_HARNESS = {"rl": "recipe_best", "rl_colab": "colab"}
_LOOP_KEYS = ("context_budget", "max_turn_tokens", "observation_reserve", "max_turns", "max_segments",
              "summary_max_tokens", "summary_prompt", "system_prompt")


def _stored_configs(checkpoints: str) -> dict:
  """The run configs RL runs stored with their checkpoints (`run_config.pkl`), by workdir (':'-joined); LM-stage
  workdirs store none."""
  found = {}
  for workdir in filter(None, checkpoints.split(":")):
    if os.path.isfile(os.path.join(workdir, "run_config.pkl")):
      from composer_jax.rl import workdir as workdir_lib
      found[workdir] = workdir_lib.stored_config(workdir)
  return found


def _stored(configs: dict, field: str) -> dict | None:
  """The `field` ("model" or "harness") the stored `configs` agree on, or None when there are none."""
  values = {w: dataclasses.asdict(getattr(c, field)) for w, c in configs.items()}
  if len({repr(v) for v in values.values()}) > 1:
    raise ValueError(f"the checkpoints {sorted(values)} were trained with different {field} configs: evaluate them "
                     f"apart, or name one with {field}=")
  return next(iter(values.values()), None)


# Config keys and args users typed before a rename: the CLI names the new one (`experiments/cli.py`).
RENAMED_KEYS = {"backend": "workspaces"}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, renames=RENAMED_KEYS, variant="procedural", n_tasks=8, levels="1", seed=0, samples=2,
                         chunk_tasks=8, policies="oracle+noop+random", repos="", jsonl="", repos_dir="", set_file="",
                         corpus="", keep_contaminated=False, checkpoint="", model="", sglang_url="",
                         workspaces="sandbox", out="runs/eval", build_set="", set_version="1", min_files=1, min_lines=1,
                         max_prompt_chars=1000, temperature=1.0, harness="")
  c = ml_collections.ConfigDict()   # mirrors composer_jax.eval_run.EvalRunConfig
  # c.set mirrors rollout.tasks.registry.SetSpec (the one task-source registry RL and SFT use too).
  c.set = ml_collections.ConfigDict(dict(
    kind=arg.variant, n=arg.n_tasks if arg.variant == "procedural" else 0, seed=arg.seed,
    split="heldout" if arg.variant == "procedural" else "all", levels=tuple(int(x) for x in arg.levels.split("+")),
    repos=tuple(r for r in arg.repos.split(":") if r), jsonl=arg.jsonl, repos_dir=arg.repos_dir, path=arg.set_file,
    heldout_percent=20, miner=dataclasses.asdict(miner.MinerConfig())))
  c.policies = tuple(n for n in arg.policies.split("+") if n)
  c.samples = arg.samples
  c.chunk_tasks = arg.chunk_tasks
  c.corpus = arg.corpus  # pretraining corpus (dir or JSONL with "text") for the contamination guard; "" = off
  c.keep_contaminated = arg.keep_contaminated
  # checkpoint.model: the shape of every checkpoint in `workdir` (':'-joined), a variant of configs/model.py.
  stored = _stored_configs(arg.checkpoint)
  model = model_configs.get_config(arg.model).to_dict() if arg.model else _stored(stored, "model")
  c.checkpoint = ml_collections.ConfigDict(dict(workdir=arg.checkpoint,
                                                model=model or model_configs.get_config("colab").to_dict()))
  c.sglang_url = arg.sglang_url
  c.workspaces = arg.workspaces  # 'sandbox' (bubblewrap) or 'local'
  c.out = arg.out
  c.seed = arg.seed
  c.gold_runs = 2  # gold validation runs each side this often (>= 2: a flaky task is invalid)
  c.builder = ml_collections.ConfigDict(dict(path=arg.build_set, version=arg.set_version, min_files=arg.min_files,
                                             min_lines=arg.min_lines, max_prompt_chars=arg.max_prompt_chars))
  # The baselines' tokenizer without a checkpoint: a saved one (`dir`) or one fitted to `train_tasks` tasks.
  c.tokenizer = ml_collections.ConfigDict(dict(dir="", train_tasks=200, fit=dict(vocab_size=1024)))
  # Mirrors rollout.harness.HarnessConfig (system_prompt names one of harness.SYSTEM_PROMPTS).
  c.harness = ml_collections.ConfigDict(dict(context_budget=4096, max_turn_tokens=1024, observation_reserve=512,
                                             max_turns=16, max_segments=3, summary_max_tokens=256,
                                             sampling=dict(temperature=arg.temperature),
                                             tools=dict(max_output_chars=2000), system_prompt="full",
                                             grade_workers=4, seed=c.get_ref("seed")))
  c.auto_budget = arg.variant != "procedural"
  # A policy is judged in the loop it was trained in: by default the one its RL checkpoint stored, else a preset.
  own = _stored(stored, "harness") if not arg.harness else None
  if arg.harness in RL_HARNESS or own is not None:
    r = own or rl_configs.get_config(RL_HARNESS[arg.harness]).harness
    c.harness.update({k: r[k] for k in _LOOP_KEYS if k in r})
    c.harness.tools.max_output_chars = r["tools"]["max_output_chars"]
    c.auto_budget = False
  elif arg.harness not in ("", "default"):
    raise ValueError(f"unknown harness preset {arg.harness!r}; valid: default, {', '.join(RL_HARNESS)}")
  return c
