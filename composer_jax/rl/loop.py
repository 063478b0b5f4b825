"""The RL loop: each step takes whole groups from a rollout source, runs the jitted RL step, publishes the weights.

`train_rl(cfg, start, run)` runs (or resumes) one RL job in `cfg.workdir` from `start` (the warm start's params,
also the frozen KL reference) with the run's tokenizer, pool and workspaces (`run`, `setup.open_run`):

  rl_start = placement.start_rl_step(cfg, run.mesh, run.rules, start)   # checked, optimizer, shardings, state, jit
  trainer = Trainer(rl_start, ...)              # the applied log at its step, the queue consumer at its cursor
  publisher = publishers.make(cfg, ...)         # in place | weight files for workers | HF checkpoint + SGLang fleet
  source = sources.make(cfg, ..., run, ...)     # in-process (sync) | worker processes (async), via the queue
  for step: groups = source.next(policy_version); trainer.step(groups); publisher.publish(params, step); checkpoint

`run_rl(cfg)` is the RL job alone (the workdir claimed, the warm start, then `train_rl`); run it in a process of
its own with `python -m composer_jax.rl.loop <workdir>` (it reads the workdir's RunConfig).
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

import jax

from composer_jax.parallel import distributed
from composer_jax.rl import placement, processes, publishers, setup, sources, warmstart
from composer_jax.rl import workdir as workdir_lib
from composer_jax.rl.config import RunConfig
from composer_jax.rl.trainer import Trainer
from composer_jax.sampling.spec_log import VersionLogReader
from composer_jax.train import interrupt
from composer_jax.train import metrics as metrics_lib


def run_rl(cfg: RunConfig, log_fn: Callable[[str], None] = print, allow_changes=()) -> dict:
  """The RL job of `cfg` alone (no held-out evaluation): it claims the workdir (`rl.workdir.claim`: one live run, a
  resume only with the stored config but for the fields named in `allow_changes`), computes the warm start and runs
  `train_rl` from it."""
  with workdir_lib.claim(cfg, allow_changes) as run:
    return train_rl(cfg, warmstart.warm_start(cfg.sft_plan, run, log_fn), run, log_fn)


def train_rl(cfg: RunConfig, start, run: setup.Run, log_fn: Callable[[str], None] = print) -> dict:
  """Runs (or resumes) the RL job of `cfg` to `cfg.rl.steps` from `start`; returns the final params, the last
  metrics and the step it resumed at (0 for a fresh run). The caller holds the workdir (`rl.workdir.claim`).
  Ctrl-C stops it after the step in flight, checkpointed (`train.interrupt.Interrupted`)."""
  last: dict = {}
  with contextlib.ExitStack() as stack:
    # Process 0 alone rolls out and logs; every process trains, publishes and checkpoints (`rl/processes.py`).
    progress = stack.enter_context(_Progress(cfg.workdir, cfg.rl.steps, cfg.progress_bar, log_fn))
    batch_cfg = placement.batch_config(cfg)
    rl_start = placement.start_rl_step(cfg, run.mesh, run.rules, start)   # checked ... restored or fresh, jitted
    trainer = Trainer(rl_start, batch_cfg, cfg.workdir, cfg.rollout.staleness, log_fn)
    stack.callback(trainer.close)
    publisher = publishers.make(cfg, trainer.params, trainer.start, log_fn)   # before the workers attach to it
    stack.callback(publisher.close)
    source = sources.make(cfg, publisher.engine, run, trainer.consumer, log_fn) if trainer.primary else None
    stack.callback(lambda: source and source.close())
    engine_stats = VersionLogReader(publishers.engine_stats_dir(cfg))   # speculative decoding per policy version
    # Ctrl-C: one process stops after the step in flight (processes of a multi-process run would not agree on it).
    stop = stack.enter_context(interrupt.StopAtStep("RL", enabled=jax.process_count() == 1))
    for step_no in range(trainer.start + 1, cfg.rl.steps + 1):
      t0 = time.perf_counter()
      groups, rollout_s = source.next(step_no - 1) if source else (None, 0.0)   # at the trainer's policy version
      idle_s = time.perf_counter() - t0
      m = trainer.step(step_no, groups)
      train_s = time.perf_counter() - t0 - idle_s
      publish_s = publisher.publish(trainer.params, step_no) if step_no % cfg.rollout.publish_every == 0 else 0.0
      step_s = time.perf_counter() - t0
      m.update(step_s=step_s, trainer_idle_s=idle_s, train_s=train_s, rollout_s=rollout_s,
               trainer_idle_fraction=idle_s / max(step_s, 1e-9), publish_s=publish_s, **engine_stats.metrics())
      last = progress.log(step_no, m)
      if stop.requested or step_no % cfg.rl.ckpt_every == 0 or step_no == cfg.rl.steps:
        trainer.checkpoint(step_no)
      if stop.requested and step_no < cfg.rl.steps:
        raise interrupt.Interrupted(f"RL stopped at step {step_no} of {cfg.rl.steps}, checkpointed in "
                                    f"{trainer.ckpts.directory}: rerun the same command to resume")
  # The final policy in workdir/weights whatever the publisher, so every RL workdir can be evaluated as one.
  processes.publish_weights(publishers.weights_dir(cfg), trainer.params, int(trainer.state.step), unless_latest=True)
  if trainer.primary:
    metrics_lib.plot_rewards(cfg.workdir)
  return {"params": trainer.params, "ref_params": trainer.ref_params, "last": last, "resumed_at": trainer.start}


class _Progress:
  """Metrics (workdir/metrics.jsonl + TensorBoard) and the progress bar (`bar`), or a log line per step without
  one; process 0 alone logs. The bar starts at the first step logged (a resumed run's: after its checkpoint)."""

  def __init__(self, workdir: str, steps: int, bar: bool, log_fn):
    primary = distributed.is_primary()
    self.writer, self.log_fn = metrics_lib.MetricWriter(workdir) if primary else None, log_fn
    self.steps, self.show_bar, self.bar = steps, bar and primary, None

  def log(self, step_no: int, m: dict) -> dict:
    if self.writer is None:   # not process 0
      return {"step": step_no, **m}
    self.writer.write(step_no, m)
    if self.show_bar:
      if self.bar is None:
        from tqdm import tqdm
        self.bar = tqdm(total=self.steps, initial=step_no - 1, desc="rl", dynamic_ncols=True)
      self.bar.update(1)
      self.bar.set_postfix(reward=f"{m['reward']:.2f}", pass_rate=f"{m['pass_rate']:.2f}", kl=f"{m['kl']:.3f}")
    else:
      self.log_fn(f"step {step_no}: reward {m['reward']:.3f} pass {m['pass_rate']:.2f} kl {m['kl']:.4f} "
                  f"idle {m['trainer_idle_s']:.2f}s/{m['step_s']:.2f}s")
    return {"step": step_no, **m}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.writer is not None:
      self.writer.close()
    if self.bar is not None:
      self.bar.close()


if __name__ == "__main__":
  run_rl(workdir_lib.load_run_config(sys.argv[1]))
