"""RL arms from one shared start, for the measurements that compare RL variants (benchmarks/mtp_rl.py,
benchmarks/tree_learning.py): the start is computed once in its own workdir, every arm loads it and runs RL (for a
number of steps, or until its steps have taken a wall-clock budget) and then the held-out evaluation of its final
policy, greedy and at T=1, per level (the SFT start's row and the equal-time SFT control are the start's and the
recipe's business, not an arm's). Each piece resumes from its workdir after an interruption and writes its result
file last, so a queue can skip what has finished.

The start is the default recipe (`experiments/configs/rl.py`, what `make run` runs) with one MTP module
(`model.num_nextn_predict_layers=1`): its SFT trains the module by self-distillation with the trunk detached, so
the trunk's SFT is the recipe's own, and one start serves the MTP arms and the arms that ignore the module.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

from composer_jax import configs
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs

# The recipes an arm can run: the default run (`make run`), `make colab`'s (level 1, minutes; a start that
# solves few tasks) and `test`'s (a tiny model, seconds; for the tests of these drivers).
RECIPES = {"default": "", "colab": "colab,mode=sync", "test": "test,mode=sync"}
RESULT = "results.json"


def recipe_config(recipe: str, workdir: str, seed: int = 0, **overrides) -> RunConfig:
  """The recipe's RunConfig with one MTP module, in `workdir`, at `seed`, with dotted `overrides`."""
  if recipe not in RECIPES:
    raise ValueError(f"unknown recipe {recipe!r}; valid: {sorted(RECIPES)}")
  arg = ",".join(a for a in (RECIPES[recipe], f"seed={seed}") if a)
  cfg = configs.from_dict(RunConfig, rl_configs.get_config(arg), workdir=workdir)
  return configs.replace(cfg, **{"model.num_nextn_predict_layers": 1, "progress_bar": False, **overrides})


def from_start(recipe: str, start_dir: str, workdir: str, seed: int, **overrides) -> RunConfig:
  """An arm's config: the recipe at `seed`, RL from the finished start in `start_dir` (no SFT of its own, so no
  curriculum and no SFT control)."""
  return recipe_config(recipe, workdir, seed, **{
      "sft.steps": 0, "sft.init_checkpoint": os.path.join(start_dir, "sft"), "sft.curriculum_levels": (),
      "sft.curriculum_steps": 0, "eval.control": False, "eval.summaries_from_start": False,
      "eval.drop_oldest": False, **overrides})


def done(workdir: str) -> dict | None:
  """The result an arm (or the start) wrote when it finished, or None."""
  path = os.path.join(workdir, RESULT)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _write(workdir: str, result: dict) -> dict:
  with open(os.path.join(workdir, RESULT), "w") as f:
    json.dump(result, f, indent=1)
  return result


def run_start(cfg: RunConfig, log_fn=print) -> dict:
  """The shared start: the recipe's SFT warm start alone (resumes from its checkpoints)."""
  from composer_jax.compile_cache import enable_compilation_cache
  from composer_jax.rl import warmstart
  from composer_jax.rl import workdir as workdir_lib
  if (got := done(cfg.workdir)) is not None:
    return got
  enable_compilation_cache()
  load0, t0 = os.getloadavg(), time.time()
  with workdir_lib.claim(cfg, ()) as run:
    warmstart.warm_start(cfg.sft_plan, run, log_fn)
  return _write(cfg.workdir, {"start": os.path.join(cfg.workdir, "sft"), "sft_steps": cfg.sft.steps,
                              "minutes_this_process": (time.time() - t0) / 60, "load_avg_start": load0,
                              "load_avg_end": os.getloadavg()})


def logged_steps(workdir: str) -> list[dict]:
  """workdir/metrics.jsonl, one row per step in step order: a step run twice (redone after a resume past its last
  checkpoint) as logged last."""
  from composer_jax.train import metrics as metrics_lib
  path = os.path.join(workdir, "metrics.jsonl")
  by_step = {r["step"]: r for r in (metrics_lib.read_metrics(path) if os.path.exists(path) else []) if "step" in r}
  return [by_step[s] for s in sorted(by_step)]


def step_seconds(workdir: str) -> dict[int, float]:
  """Each logged RL step's wall-clock (`logged_steps`)."""
  return {r["step"]: r["step_s"] for r in logged_steps(workdir) if "step_s" in r}


class StopAfter:
  """While entered, polls the run's logged step times and, once they sum to `budget_s` seconds before step
  `last_step`, asks the RL loop to stop as Ctrl-C does (SIGINT: it finishes the step in flight, checkpoints it and
  raises `Interrupted`), so a run stopped by wall-clock is one process with one set of compiles."""

  def __init__(self, workdir: str, budget_s: float, last_step: int, poll_s: float = 2.0):
    self.workdir, self.budget_s, self.last_step, self.poll_s = workdir, budget_s, last_step, poll_s
    self.fired = False
    self._done = threading.Event()

  def due(self) -> bool:
    seconds = step_seconds(self.workdir)
    return sum(seconds.values()) >= self.budget_s and max(seconds, default=0) < self.last_step

  def _watch(self):
    while not self._done.wait(self.poll_s):
      if self.due():
        self.fired = True
        os.kill(os.getpid(), signal.SIGINT)
        return

  def __enter__(self):
    self._thread = threading.Thread(target=self._watch, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._done.set()
    self._thread.join()


def run_arm(cfg: RunConfig, budget_s: float | None = None, log_fn=print) -> dict:
  """RL from the start for `cfg.rl.steps` steps, or (`budget_s`) until the steps have taken `budget_s` seconds of
  wall-clock (at most `cfg.rl.steps`); then the held-out evaluation of the final policy. Resumes after an
  interruption; returns (and writes) the result."""
  from composer_jax.compile_cache import enable_compilation_cache
  from composer_jax.rl import experiment, loop, warmstart
  from composer_jax.rl import workdir as workdir_lib
  from composer_jax.train import interrupt
  if (got := done(cfg.workdir)) is not None:
    return got
  enable_compilation_cache()
  load0, t0 = os.getloadavg(), time.time()
  with workdir_lib.claim(cfg, ()) as run:
    start = warmstart.warm_start(cfg.sft_plan, run, log_fn)
    steps = cfg.rl.steps
    if budget_s is not None:
      spent = sum(step_seconds(cfg.workdir).values())
      if spent < budget_s:
        try:
          with StopAfter(cfg.workdir, budget_s, cfg.rl.steps):
            loop.train_rl(cfg, start, run, log_fn)
        except interrupt.Interrupted as e:
          log_fn(f"stopped by the wall-clock budget of {budget_s:.0f} s: {e}")
      steps = max(step_seconds(cfg.workdir), default=0)
    out = loop.train_rl(configs.replace(cfg, **{"rl.steps": steps}), start, run, log_fn)   # resumes at `steps`
    t1 = time.time()
    rows = experiment.evaluate_at_temperatures(cfg, out["params"], run, run.heldout, experiment.at_step("rl", steps))
    seconds = step_seconds(cfg.workdir)
    return _write(cfg.workdir, {
        "rl": rows, "rl_steps": steps, "rl_seconds": sum(s for k, s in seconds.items() if k <= steps),
        "budget_s": budget_s, "eval_tasks": len(run.heldout), "eval_minutes": (time.time() - t1) / 60,
        "minutes_this_process": (time.time() - t0) / 60, "load_avg_start": load0, "load_avg_end": os.getloadavg()})
