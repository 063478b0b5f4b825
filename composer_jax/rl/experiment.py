"""The full experiment behind `experiments/rl_main.py`: warm start → RL → held-out evaluation (+ SFT control).

Three policies are evaluated on the same held-out tasks, greedy and at T=1 (`eval.temperatures`), with Wilson 95%
CIs: the SFT start, the RL policy, and a control that spends RL's wall-clock on more SFT from the same start (so a
gain is RL's, not more supervised training); with `eval.summaries_from_start`, also the RL policy acting with the
SFT start's self-summaries, and with `eval.drop_oldest` the RL policy without summaries (oldest turns dropped): do
RL's trained summaries help, at the same context budget? Those two rows run on the tasks that need a summary
(`eval.summary_levels`). What depends on the RL policy is kept per RL step count (`at_step`): a run grown to more
RL steps evaluates its new policy, sizes and trains its own control afresh, and keeps the earlier results.
`eval.start_only` calibrates a start before a long run: the warm start and its evaluation, nothing else
(does each level reach the ~20% at T=1 that a group of 8 needs to hold a success?).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

from composer_jax.parallel import distributed
from composer_jax.rl import evaluate, loop, processes, publishers, setup, warmstart
from composer_jax.rl import workdir as workdir_lib
from composer_jax.rl.config import RunConfig
from composer_jax.sampling.engine import JaxEngine
from composer_jax.train import metrics as metrics_lib
from rollout import chat_format
from rollout.engines import split


def _engine(cfg: RunConfig, params, mesh=None) -> JaxEngine:
  """An evaluation engine: where `params` are, or a replica on each device of `mesh` (`processes.for_local_engine`)."""
  return JaxEngine(params, cfg.model, dataclasses.replace(publishers.engine_config(cfg), min_batch_bucket=64,
                                                          max_batch=64), mesh=mesh, placement="replicas")


def evaluate_at_temperatures(cfg: RunConfig, params, run: setup.Run, tasks, name: str, summarizer_params=None) -> dict:
  """Success of policy `name` on `tasks` at each of `eval.temperatures` (0 = greedy); results in workdir/eval.
  With `summarizer_params`, those params write the self-summaries (`rollout.engines.split.SummariesFrom`).
  Across processes, process 0 evaluates on its own devices (every process calls this: the params are gathered to
  it) and returns the figures; the others return None."""
  params, mesh = processes.for_local_engine(params)
  if summarizer_params is not None:
    summarizer_params, _ = processes.for_local_engine(summarizer_params)

  def run_all() -> dict:
    eng, tok = _engine(cfg, params, mesh), run.tokenizer
    if summarizer_params is not None:
      eng = split.SummariesFrom(eng, _engine(cfg, summarizer_params, mesh),
                                chat_format.special_id(tok, chat_format.SUMMARY))
    return {f"T{t:g}": evaluate.success_rate(eng, tok, tasks, run.envs, cfg.harness, t,
                                             evaluate.out_dir(cfg.workdir, name, t), policy=name,
                                             progress=cfg.progress_bar)
            for t in cfg.eval.temperatures}
  return processes.on_primary("evaluate", run_all)


def at_step(name: str, rl_steps: int) -> str:
  """The name of a policy that depends on the RL policy after `rl_steps` steps (RL itself, the control sized by its
  wall-clock, the summary rows), and so of its dirs (workdir/eval/<name>, workdir/<control's name>): a run grown to
  more RL steps evaluates its new policy and trains a new control instead of reading back the earlier ones."""
  return f"{name}@{rl_steps}"


CONTROL_RECORD = "control.json"   # in the control's dir: its size, fixed when first chosen


def control_dir(workdir: str, rl_steps: int) -> str:
  """Where the control for `rl_steps` RL steps trains and records its size."""
  return os.path.join(workdir, at_step("sft_control", rl_steps))


def sft_control(cfg: RunConfig, run: setup.Run, start_params, seconds: float, log_fn) -> dict:
  """More SFT from the same start for about `seconds` of wall-clock (steps at the warm start's measured rate of SFT
  steps, `warmstart.seconds_per_step`: the control reads the start's demonstrations, so making them is not in it).

  It trains in workdir/sft_control@<RL steps>, its size chosen once and recorded there in control.json: a rerun (an
  evaluation resumed, or grown to more held-out tasks) trains no further and evaluates the same control, whatever
  its own RL wall-clock; a run grown to more RL steps gets a control of its own, from the start again (SFT's
  learning-rate schedule spans its steps, so a longer control is not the shorter one continued)."""
  out_dir = control_dir(cfg.workdir, cfg.rl.steps)

  def choose() -> dict:   # across processes, process 0's wall-clock sizes it for all
    size = control_size(cfg.workdir, cfg.rl.steps)
    if size is None:
      s_per_step = warmstart.seconds_per_step(cfg.workdir)
      size = {"steps": max(1, int(seconds / s_per_step)), "seconds": seconds, "seconds_per_step": s_per_step}
      os.makedirs(out_dir, exist_ok=True)
      with open(os.path.join(out_dir, CONTROL_RECORD), "w") as f:
        json.dump(size, f)
    return size
  size = processes.on_primary("control_size", choose, share=lambda size: size)
  log_fn(f"SFT control: {size['steps']} more steps (~{size['seconds']:.0f} s at {size['seconds_per_step']:.2f} "
         "s/step)")
  params, last = warmstart.sft(cfg.sft_plan, run, start_params, out_dir, steps=size["steps"],
                               learning_rate=cfg.sft.learning_rate / 3, seed=cfg.seed + 1, log_fn=log_fn)
  log_fn(f"SFT control done: loss {(last or {}).get('loss', float('nan')):.3f}")
  return params


def control_size(workdir: str, rl_steps: int) -> dict | None:
  """The recorded size ({steps, seconds, seconds_per_step}) of the control for `rl_steps` RL steps, or None before
  it is chosen."""
  path = os.path.join(control_dir(workdir, rl_steps), CONTROL_RECORD)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def without_summaries(cfg: RunConfig) -> RunConfig:
  """`cfg` with `HarnessConfig.without_summaries()` (and a step that could hold its longer chains, which the
  config checks; evaluation trains nothing)."""
  harness = cfg.harness.without_summaries()
  rows = max(cfg.batch_rows, cfg.rollout.samples_per_prompt * harness.max_segments)
  return dataclasses.replace(cfg, harness=harness, rl=dataclasses.replace(cfg.rl, rows_per_step=rows))


def summary_tasks(cfg: RunConfig, tasks: list) -> list:
  """The held-out tasks of the summary rows: those of a level in `eval.summary_levels`, or all when it is empty."""
  if not cfg.eval.summary_levels:
    return tasks
  chosen = setup.of_levels(tasks, cfg.eval.summary_levels)
  if not chosen:
    found = sorted({t.metadata.get("level") for t in tasks}, key=str)
    raise ValueError(f"eval.summary_levels={cfg.eval.summary_levels} matches none of the {len(tasks)} held-out "
                     f"tasks (their levels: {found})")
  return chosen


def reward_terms_by_quarter(workdir: str) -> dict[str, list[float]]:
  """The reward, its task term and each penalty term that was ever nonzero, as means over each quarter of the RL
  steps (workdir/metrics.jsonl): is any term rising while the task term does not?"""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  rows = metrics_lib.read_metrics(path)
  return metrics_lib.part_means(rows, ["reward", "reward/task", *metrics_lib.penalty_terms(rows)])


def earlier_rl_seconds(workdir: str, resumed_at: int) -> float:
  """The step time of RL steps 1..`resumed_at`, run by the runs a resumed one continues (workdir/metrics.jsonl; a
  step run twice, after a crash past its last checkpoint, counts once, as the run that checkpointed it logged it
  last). Added to a resumed run's own RL wall-clock, it is what the RL policy cost, which the control gets."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not resumed_at:
    return 0.0
  rows = metrics_lib.read_metrics(path) if os.path.exists(path) else []
  steps = {r["step"]: r["step_s"] for r in rows if "step_s" in r and r["step"] <= resumed_at}
  if len(steps) < resumed_at:
    raise ValueError(f"{path} has the step time of {len(steps)} of the {resumed_at} RL steps this run resumed after: "
                     "the equal-wall-clock control cannot be sized (run the control by hand, or start RL afresh)")
  return sum(steps.values())


def run_experiment(cfg: RunConfig, log_fn: Callable[[str], None] = print, allow_changes=()) -> dict:
  """Runs (or resumes) the RL job and evaluates SFT start, RL and (`eval.control`) the SFT control; returns numbers.
  With `eval.start_only`, the warm start and its evaluation only.

  It claims the workdir first (`rl.workdir.claim`: one live run, a resume only with the stored config but for the
  fields named in `allow_changes`, and the run's tokenizer, tasks and workspaces built once, which checks the run's
  input before any work); every phase then shares them."""
  with workdir_lib.claim(cfg, allow_changes) as run:
    t0 = time.perf_counter()
    start = warmstart.warm_start(cfg.sft_plan, run, log_fn)
    phases = {"sft_start": time.perf_counter() - t0}   # wall-clock seconds of each phase (a resumed one: its rest)
    out = None
    if not cfg.eval.start_only:
      t1 = time.perf_counter()
      out = loop.train_rl(cfg, start, run, log_fn)
      phases["rl"] = time.perf_counter() - t1
      rl_seconds = phases["rl"] + earlier_rl_seconds(cfg.workdir, out["resumed_at"])   # a resumed run: all of it

    def timed(name, fn, *args, **kwargs):
      t = time.perf_counter()
      value = fn(*args, **kwargs)
      phases[name] = time.perf_counter() - t
      return value
    result = {"sft": timed("eval_sft", evaluate_at_temperatures, cfg, start, run, run.heldout, "sft")}
    if out is not None:
      result.update(_trained_rows(cfg, start, out["params"], rl_seconds, run, timed, log_fn))
    phases["total"] = time.perf_counter() - t0
    result.update(eval_tasks=len(run.heldout), phase_seconds=phases)
    if out is None:
      result.update(start_only=True, sft_steps=cfg.sft.steps, sft_tasks=cfg.sft.tasks,
                    sft_curriculum_steps=cfg.sft.curriculum_steps)
    else:
      result.update(rl_seconds=rl_seconds, rl_steps=cfg.rl.steps, reward_terms=reward_terms_by_quarter(cfg.workdir),
                    last={k: v for k, v in out["last"].items() if isinstance(v, float)})
    if not distributed.is_primary():   # its evaluation rows are None (`evaluate_at_temperatures`): process 0 reports
      return result
    earlier = earlier_phase_seconds(cfg.workdir)
    if earlier:
      result.update(earlier_phase_seconds=earlier)
    with open(os.path.join(cfg.workdir, "results.json"), "w") as f:
      json.dump(result, f, indent=2)
    return result


def earlier_phase_seconds(workdir: str) -> list[dict]:
  """The phase times of every earlier invocation that wrote workdir/results.json, oldest first: a resumed or grown
  run's own `phase_seconds` hold only its rest, and its results.json keeps what the runs before it took."""
  path = os.path.join(workdir, "results.json")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    previous = json.load(f)
  return previous.get("earlier_phase_seconds", []) + [previous.get("phase_seconds", {})]


def _trained_rows(cfg: RunConfig, start, params, rl_seconds: float, run: setup.Run, timed, log_fn) -> dict:
  """The RL policy's rows, the equal-time SFT control and the summary rows on the held-out tasks
  (`timed(name, fn, ...)` records each phase's wall-clock), each evaluated under its name `at_step` the run's RL
  steps."""
  steps, tasks = cfg.rl.steps, run.heldout
  rows = {"rl": timed("eval_rl", evaluate_at_temperatures, cfg, params, run, tasks, at_step("rl", steps))}
  if cfg.eval.control and cfg.sft.steps:
    ctrl = timed("sft_control", sft_control, cfg, run, start, rl_seconds, log_fn)
    rows["sft_control"] = timed("eval_sft_control", evaluate_at_temperatures, cfg, ctrl, run, tasks,
                                at_step("sft_control", steps))
    if (size := control_size(cfg.workdir, steps)) is not None:
      rows.update(control_steps=size["steps"], control_seconds=size["seconds"])
  if cfg.eval.summaries_from_start or cfg.eval.drop_oldest:
    needs_summary = summary_tasks(cfg, tasks)
  if cfg.eval.summaries_from_start:   # do RL's trained summaries help? the RL policy with the start's summaries
    rows["rl_start_summaries"] = timed("eval_rl_start_summaries", evaluate_at_temperatures, cfg, params, run,
                                       needs_summary, at_step("rl_start_summaries", steps), summarizer_params=start)
  if cfg.eval.drop_oldest:   # ... and against no summaries at all
    rows["rl_drop_oldest"] = timed("eval_rl_drop_oldest", evaluate_at_temperatures, without_summaries(cfg), params,
                                   run, needs_summary, at_step("rl_drop_oldest", steps))
  return rows
