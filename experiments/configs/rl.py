r"""RL on a task source (procedural repair tasks by default): SFT warm start on oracle trajectories, then
(a)synchronous RL with workers, then held-out evaluation.

  python experiments/rl_main.py                                              # the default run, runs/rl (make run)
  python experiments/rl_main.py --config=experiments/configs/rl.py:colab --workdir=runs/rl_colab   # make colab
  python experiments/rl_main.py --config=experiments/configs/rl.py:test --workdir=/tmp/rl_test   # seconds-scale

Does: SFT warm start on oracle transcripts, RL for `rl.steps`, then held-out evaluation of the SFT start, the RL
policy and an equal-wall-clock SFT control on `eval.tasks` held-out tasks (per level for a procedural mix), greedy
and at T=1 (Wilson 95% CIs); the last line is JSON, also in workdir/results.json with each phase's time
(experiments/results/README.md has the measured runs; `experiments/report_main.py` renders them).

The default run (`DEFAULT`, `make run`): procedural levels 1-3, self-summary chains, the length penalty C(x) and the
behavioural terms on, a curriculum start taught half near misses (900 + 3600 SFT steps), 300 RL steps at KL β 5e-2,
500 held-out tasks per level; ~1 h on 2 idle cores. Measured: RL beat its start by over 15 and the equal-time control
by over 10 points on levels 2-3 at T=1, on both seeds (experiments/results/recipe_calibration.md says how each value
was chosen). Every value the default run does not name is its dataclass's default (`composer_jax.rl.config`): the
config starts from those (`common.defaults_of`), so every field can be set with `--config.<section>.<field>`.

Variants, each a few overrides of the default: `colab` (`make colab`: level-1 tasks, read, edit, finish; 10-20 min
on 2 idle cores), `curriculum` (levels 1-2 from a curriculum start), `colab_pretrained` (colab with SFT from the
colab pretraining run, `make pretrain`, and its tokenizer), `recipe` (the recipe as first calibrated, which
`get_sweep()`'s rows override), `test` (tiny model, few tasks, local workspaces). `colab_level1` names colab.
Arg overrides: `mode=sync|async`, `steps=`, `workers=`, `staleness=`, `samples=`, `workspaces=local|sandbox`,
`engine=jax|sglang` (rollouts on a fleet of real SGLang servers, `servers=` of them; the CPU install is `make
test`'s), `seed=`; the task source (`rollout/tasks/registry.py`): `tasks=procedural` with `levels=1` or a mix
`levels=1+2+3`, `tasks=mined,repos=/src/a:/src/b`, `tasks=swe,jsonl=x.jsonl,repos_dir=/src`,
`tasks=file,set_file=sets/x_v1.json` (held-out tasks are the source's 'heldout' side); any field:
`--config.rl.loss.kl_coef=0.01`, `--config.harness.rewards.length_weight=0.001`.
Calibrating a start before a long run: `--config.eval.start_only=True` runs the warm start and evaluates it on the
held-out tasks (per level), nothing else; its results.json has only the `sft` row.
Ablations: `get_sweep()` = `get_sweep("recipe")`: the default run's measurement rows, each overriding `rl.py:recipe`
(seeds, KL β, temperature, summaries vs dropped oldest turns, λ = 0 vs λ > 0 at q = 0, 0.5, 1; the default run is
one of them, `LONG_START`); `get_sweep("colab")`: router replay, length penalty q, KL β, max_staleness, samples per
prompt; `get_sweep("curriculum")`: its calibration rows and its run.
"""
import ml_collections

from composer_jax.rl.config import RunConfig
from experiments.configs import common
from experiments.configs import model as model_configs
from rollout import harness, rewards

# What an oracle-length level-3 episode (x = 321 generated tokens, the measured median of the scripted oracle's
# chains) pays of the length penalty C(x) at every q (`_length_weight`).
LEVEL3_TOKENS, LEVEL3_COST = 321, 0.1


def _length_weight(q: float) -> float:
  """λ for shape q: the weight at which an oracle-length level-3 episode pays LEVEL3_COST, so the q rows of the
  sweep differ in C's shape (how much more a long episode pays than a short one), not in its overall scale."""
  return LEVEL3_COST / rewards.length_penalty(LEVEL3_TOKENS, rewards.RewardConfig.length_k, q)


# The default run. Each value's measurement is in experiments/results/recipe_calibration.md.
DEFAULT = {
    "tasks": dict(levels=(1, 2, 3)),
    # A level-3 episode needs 2-3 segments (its oracle's chains); levels 1-2 finish in one. The summary is asked
    # for once the context passes 496 - 112 - 128 = 256 tokens.
    "harness": dict(system_prompt="short", context_budget=496, max_turn_tokens=112, observation_reserve=128,
                    max_turns=10, max_segments=4, summary_max_tokens=56, summary_prompt="Summarize.",
                    tools=dict(max_output_chars=300),
                    # C(x) at q = 0.5 and the behavioural terms, lint off; penalty_cap 0.5 floors their sum, so
                    # a solved episode always outscores an unsolved one; effort terms charged to solved ones only.
                    rewards=dict(length_weight=_length_weight(0.5), lint_weight=0.0, penalty_cap=0.5,
                                 effort_scope="solved")),
    # A curriculum start: 900 steps on the level-1 demonstrations, then 3600 on every level's, half near misses.
    "sft": dict(steps=3600, tasks=2048, batch=8, seq_len=512, demo_accuracy=0.5, curriculum_levels=(1,),
                curriculum_steps=900),
    "rl": dict(steps=300, rows_per_step=48, ckpt_every=20, loss=dict(kl_coef=5e-2)),
    # 500 held-out tasks per level; the summary rows on level 3, the only level that needs a summary.
    "eval": dict(tasks=1500, summaries_from_start=True, drop_oldest=True, summary_levels=(3,)),
}

# `colab` (make colab): level 1 (read, edit, finish) in one short context, a plain start of 900 SFT steps on half
# near misses, 100 RL steps at KL β 1e-3, every episode paying the effort terms.
COLAB = {"tasks.levels": (1,), "harness.context_budget": 320, "harness.max_turn_tokens": 48,
         "harness.observation_reserve": 64, "harness.max_turns": 4, "harness.max_segments": 1,
         "harness.summary_max_tokens": 48, "harness.summary_prompt": harness.SUMMARY_PROMPT,
         "harness.rewards.effort_scope": "all", "sft.steps": 900, "sft.tasks": 1024, "sft.batch": 16,
         "sft.seq_len": 256, "sft.curriculum_levels": (), "sft.curriculum_steps": 0, "rl.steps": 100,
         "rl.rows_per_step": 0, "rl.loss.kl_coef": 1e-3, "eval.tasks": 500, "eval.summaries_from_start": False,
         "eval.drop_oldest": False, "eval.summary_levels": ()}
# `curriculum`: levels 1-2 from a curriculum start (level 1 first, then both), 300 RL steps; max_turn_tokens=96
# holds the longest level-2 oracle turn (87 tokens).
CURRICULUM = {**COLAB, "tasks.levels": (1, 2), "harness.context_budget": 384, "harness.max_turn_tokens": 96,
              "sft.tasks": 2048, "sft.curriculum_levels": (1,), "sft.curriculum_steps": 900, "rl.steps": 300,
              "eval.tasks": 1000}
# `colab_pretrained`: colab from the colab pretraining run (`make pretrain`) with its code tokenizer, which spends
# more tokens on a tool call's JSON.
COLAB_PRETRAINED = {**COLAB, "tokenizer.vocab_size": 4096, "harness.context_budget": 384,
                    "harness.max_turn_tokens": 64, "harness.summary_max_tokens": 64,
                    "sft.init_checkpoint": "runs/pretrain_colab"}
# `test`: seconds-scale, plain-directory workspaces.
TEST = {**COLAB, "progress_bar": False, "tasks.n": 256, "sft.steps": 4, "sft.tasks": 16, "sft.batch": 4,
        "sft.demo_accuracy": 1.0, "rl.steps": 4, "rl.groups_per_step": 2, "rl.ckpt_every": 2,
        "rollout.samples_per_prompt": 2, "rollout.workspaces": "local", "eval.tasks": 8, "eval.control": False}

# The sweep rows: the recipe from a curriculum start (900 SFT steps on the level-1 demonstrations first);
# NEARMISS_CURRICULUM, the rows where RL learns levels 2-3: that start taught half near misses, 300 RL steps.
RECIPE_CURRICULUM = {"sft.curriculum_levels": (1,), "sft.curriculum_steps": 900}
NEARMISS_CURRICULUM = {**RECIPE_CURRICULUM, "sft.demo_accuracy": 0.5, "rl.steps": 300}
# The best of them: 50x the KL beta, evaluated on 500 held-out tasks per level.
NEARMISS_CURRICULUM_KL = {**NEARMISS_CURRICULUM, "rl.loss.kl_coef": 5e-2, "eval.tasks": 1500}
# The same from a start trained twice as long on all levels: the default run.
LONG_START = {**NEARMISS_CURRICULUM_KL, "sft.steps": 3600}
# `recipe`: the recipe as first calibrated, which the sweep rows override (the default run is its LONG_START row).
RECIPE = {"sft.steps": 1800, "sft.demo_accuracy": 1.0, "sft.curriculum_levels": (), "sft.curriculum_steps": 0,
          "rl.steps": 80, "rl.loss.kl_coef": 1e-3, "eval.tasks": 600}
VARIANTS = {"recipe_best": {}, "recipe": RECIPE, "colab": COLAB, "colab_level1": COLAB, "curriculum": CURRICULUM,
            "colab_pretrained": COLAB_PRETRAINED, "test": TEST}
MODELS = {"test": "tiny", "colab_pretrained": "colab"}   # the rest: rl_colab

# A repository task's oracle writes its gold patch in one write_file call: a whole diff in one turn. The run checks
# before its demonstrations that the set's oracle fits (`composer_jax/rl/setup.py`) and names the values that do
# when it does not. 256-token turns in a 1,024-token context hold a patch of ~230 tokens. The engine pads a prompt
# (up to 768 tokens) and a turn to powers of two: 1,024 + 256 positions, more than rl_colab's 1,024 (positions
# size only the RoPE tables, no parameter).
REPOSITORY_TASKS = {"tasks.n": 0, "harness.context_budget": 1024, "harness.max_turn_tokens": 256,
                    "harness.summary_max_tokens": 256, "model.max_position_embeddings": 2048, "sft.seq_len": 512,
                    "sft.demo_accuracy": 1.0}   # near misses are procedural only

# The no-summary arm: the oldest turns are dropped instead. Segments are not the context budget (max_turns bounds
# the episode); a segment of kept recent turns fills again sooner than one from a summary, so it may take more.
DROP_OLDEST = {"overflow": "drop_oldest", "max_segments": harness.DROP_OLDEST_MAX_SEGMENTS}

# Config keys and args users typed before a rename: the CLI names the new one (`experiments/cli.py`).
RENAMED_KEYS = {"train": "rl", "rl.temperature": "harness.sampling.temperature",
                "rollout.backend": "rollout.workspaces"}
RENAMED_ARGS = {"backend": "workspaces"}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, renames=RENAMED_ARGS, variant="recipe_best", mode="async", steps=0, workers=1,
                         staleness=-1, samples=0, workspaces="", seed=0, engine="jax", servers=1, tasks="procedural",
                         levels="", repos="", jsonl="", repos_dir="", set_file="")
  if arg.variant not in VARIANTS:
    raise ValueError(f"unknown rl variant {arg.variant!r}; valid: {', '.join(sorted(VARIANTS))}")
  model = model_configs.get_config(MODELS.get(arg.variant, "rl_colab"))
  if arg.variant == "test":
    model.update(num_nextn_predict_layers=0, max_position_embeddings=1024)
  c = common.defaults_of(RunConfig, model=model)
  del c.rl["temperature"]   # RunConfig derives it from harness.sampling.temperature
  common.override(c, DEFAULT, VARIANTS[arg.variant])
  if arg.tasks != "procedural":
    common.override(c, REPOSITORY_TASKS)
  # Args: the task source, then the rollout's shape. `--config.seed` moves every seed with it.
  c.seed = arg.seed
  c.tasks.update(kind=arg.tasks, seed=c.get_ref("seed") + 1, repos=tuple(r for r in arg.repos.split(":") if r),
                 jsonl=arg.jsonl, repos_dir=arg.repos_dir, path=arg.set_file)
  if arg.levels:
    c.tasks.levels = tuple(int(x) for x in arg.levels.split("+"))
  c.harness.seed = c.get_ref("seed")
  c.rl.steps = arg.steps or c.rl.steps
  c.rollout.update(mode=arg.mode, engine=arg.engine, workers=arg.workers,
                   samples_per_prompt=arg.samples or c.rollout.samples_per_prompt,
                   max_staleness=0 if arg.mode == "sync" else (arg.staleness if arg.staleness >= 0 else 2),
                   workspaces=arg.workspaces or c.rollout.workspaces)
  c.rollout.sglang.servers = arg.servers
  return c


def _recipe_sweep():
  """The measurement rows of `rl.py:recipe`, one run each (`--config.<key>=<value>` per pair).

  Every run evaluates the SFT start, RL and the equal-wall-clock SFT control per level, greedy and at T=1 (so the
  first rows answer "does RL learn beyond copying" and "does greedy improve"); the others are one seed each.
  """
  return ([{"seed": s} for s in (0, 1)]                                              # the default comparison
          + [{"rl.steps": 240}]                                                      # 3x the RL steps
          + [{"sft.demo_accuracy": 0.5}]               # a start that imitates near misses (as rl.py:colab's)
          + [{"rl.loss.kl_coef": b} for b in (0.0, 1e-2)]                            # greedy: the KL β
          + [{"harness.sampling.temperature": 0.7}]                                 # greedy: rollout temperature
          + [{**{f"harness.{k}": v for k, v in DROP_OLDEST.items()},   # summaries vs dropped oldest turns (the SFT
              "rl.rows_per_step": 8 * DROP_OLDEST["max_segments"]}]         # a group of 8 chains of up to 8 rows
          # start's summaries are in every run: eval.summaries_from_start)
          + [{"harness.rewards.length_weight": 0.0}]                                 # λ = 0
          + [{"harness.rewards.length_weight": _length_weight(q), "harness.rewards.length_q": q}
             for q in (0.0, 1.0)]                     # λ > 0 at q = 0 and 1; q = 0.5 is the recipe (the seed rows)
          # a curriculum start (level 1 first, its BPE fitted to level 1, as rl.py:curriculum's): calibrated, then
          # the run from it for 300 steps; the same from a curriculum start taught half near misses, with the
          # effort terms charged to solved episodes (the recipe's; seeds 0 and 1) and to every episode (where RL
          # learned to quit)
          + [{**RECIPE_CURRICULUM, "eval.start_only": True}, {**RECIPE_CURRICULUM, "rl.steps": 300}]
          # (the seed rows and the KL rows below evaluate 500 held-out tasks per level: each measured run first
          # evaluated 200 and grew to 500 by a rerun with eval.tasks=1500)
          + [{**NEARMISS_CURRICULUM, "seed": s, "eval.tasks": 1500} for s in (0, 1)]
          + [{**NEARMISS_CURRICULUM, "harness.rewards.effort_scope": "all"}]
          # greedy: 10x the KL β from those starts (copied in; the control is the seed rows' above)
          + [{**NEARMISS_CURRICULUM, "seed": s, "rl.loss.kl_coef": 1e-2, "eval.control": False, "eval.tasks": 1500}
             for s in (0, 1)]
          # and 50x (copied in: the seed rows' start and control, with its recorded size control.json)
          + [{**NEARMISS_CURRICULUM_KL, "seed": s} for s in (0, 1)]
          # and from the start trained twice as long: calibrated (200 held-out tasks per level), then the run
          + [{**LONG_START, "eval.start_only": True, "eval.tasks": 600}]
          + [{**LONG_START, "seed": s} for s in (0, 1)])


def _curriculum_sweep():
  """The rows of `rl.py:curriculum`: its start calibrated beside the same 1800 steps on the mix from the start (no
  curriculum), then the run itself (start, RL, equal-time control) for two seeds, and rollouts at T = 0.7 (for
  greedy; the trainer scores at the rollouts' temperature)."""
  return [{"eval.start_only": True},
          {"eval.start_only": True, "sft.curriculum_levels": (), "sft.curriculum_steps": 0, "sft.steps": 1800},
          {"seed": 0}, {"seed": 1},
          {"harness.sampling.temperature": 0.7, "eval.control": False}]


def get_sweep(arg: str | None = None):
  """Ablations of the variant `arg` names, each one command (`--config.<key>=<value>` per pair): by default and for
  `recipe` the recipe's measurement rows (each overrides `rl.py:recipe`; the default run, recipe_best, is one of
  them), for `curriculum` its rows, for colab router replay, length penalty (λ = 0, q), KL β, staleness, group
  size."""
  if arg in (None, "", "recipe"):
    return _recipe_sweep()
  if arg == "curriculum":
    return _curriculum_sweep()
  if arg not in ("colab", "colab_level1"):
    raise ValueError(f"no sweep for rl variant {arg!r} (recipe_best is a row of get_sweep('recipe'), whose rows "
                     "override rl.py:recipe); valid: colab, colab_level1, curriculum, recipe")
  return ([{"rl.router_replay": r} for r in (True, False)]
          + [{"harness.rewards.length_weight": 0.0}]                   # λ = 0; the default is λ > 0 at q = 0.5
          + [{"harness.rewards.length_weight": _length_weight(q), "harness.rewards.length_q": q} for q in (0.0, 1.0)]
          + [{"rl.loss.kl_coef": b} for b in (0.0, 1e-3, 1e-2)]
          + [{"rollout.max_staleness": 0, "rollout.mode": "sync"}]
          + [{"rollout.max_staleness": s} for s in (2, 8)]
          + [{"rollout.samples_per_prompt": g} for g in (4, 8, 16)])
