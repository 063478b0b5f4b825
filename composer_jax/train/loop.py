"""The host-side training loop shared by every language-model stage.

Order per step: dispatch step t, then fetch step t−1's metrics (so the host never idles the device), log every
`log_every` steps, evaluate held-out perplexity every `eval_every`, checkpoint every `ckpt_every` — only after the
host has seen that step's loss finite, so the newest checkpoint is always a good one. A non-finite loss stops the
run with `NonFiniteLossError`.

Meshes and processes: params, optimizer state and batches are placed by `ShardingRules` on the given mesh (checked
for divisibility first). With several processes (`composer_jax.parallel.distributed`) every process runs this same
loop; `train_iter` yields only this process's rows of the global batch (`layout.process_batch_shard` says which),
only process 0 writes metrics and the progress bar, and all processes take part in each orbax checkpoint.

Ctrl-C (one process) stops the loop after the step in flight: it checkpoints that step with the data iterator and
raises `interrupt.Interrupted`, so a rerun resumes exactly there.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np

from composer_jax import model
from composer_jax.model.config import ModelConfig
from composer_jax.parallel import distributed, layout
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.parallel.rules import ShardingRules
from composer_jax.train import checkpoint as ckpt_lib
from composer_jax.train import interrupt, optim
from composer_jax.train import metrics as metrics_lib
from composer_jax.train import step as step_lib
from composer_jax.train.config import OptimConfig, TrainConfig


class NonFiniteLossError(RuntimeError):
  pass


def _place(x, sharding):
  """`x` on `sharding`: as is if already there, else from a host copy (every process holds the same values)."""
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
    return x
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _discard(_msg: str) -> None:
  """The log function of non-primary processes."""


def single_device_mesh():
  """The default mesh: one device (the parallelism config chooses bigger meshes)."""
  return mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])


def _all_processes(flag: bool) -> bool:
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.asarray(flag))))


def evaluate(eval_step, params, batches: Iterable[dict], put) -> dict:
  """Held-out loss over `batches`; a process whose shard runs out early feeds all-padding rows until all are done."""
  nll, count = 0.0, 0.0
  it, pad = iter(batches), None
  while True:
    batch = next(it, None)
    if _all_processes(batch is None):
      break
    if batch is None:
      if pad is None:
        raise ValueError("This process's held-out shard produced no batch; use fewer processes or more held-out data")
      batch = pad
    pad = {k: np.zeros_like(v) for k, v in batch.items()}   # all-padding rows count no tokens
    out = jax.device_get(eval_step(params, put(batch)))
    nll += float(out["nll_sum"])
    count += float(out["count"])
  if count == 0:
    raise ValueError("The held-out set produced no target tokens; check the corpus split and eval_batches")
  return {"eval_loss": nll / count, "eval_perplexity": math.exp(min(nll / count, 50.0)), "eval_tokens": count}


def train(*, model_cfg: ModelConfig, train_cfg: TrainConfig, optim_cfg: OptimConfig, workdir: str,
          train_iter: Iterator[dict], eval_batches: Callable[[], Iterable[dict]], init_params=None,
          mesh=None, rules=None, log_fn: Callable[[str], None] = print) -> tuple[dict, dict]:
  """Trains until `train_cfg.steps`, resuming from `workdir` if it holds a checkpoint.

  Args:
    train_iter: a checkpointable grain iterator of numpy batches (`tokens`, `segment_ids`, `positions`,
      `loss_mask`), saved and restored with the state.
    eval_batches: returns a fresh, finite, deterministic iterable of held-out batches.
    init_params: start from these (e.g. a previous stage or a Hugging Face checkpoint) instead of random init;
      ignored when resuming.
    mesh: the device mesh (default: one device); a resumed run may use another mesh than the saving one.
    rules: logical-axis table (default `ShardingRules()`, FSDP on `data`).
  Returns:
    (final params, the last logged metrics including the final held-out evaluation).
  """
  mesh = mesh if mesh is not None else single_device_mesh()
  # The expert- and context-parallel regions (moe_impl="ep_*", attention_impl="ring"/"allgather") read the mesh
  # from context at trace time.
  with jax.set_mesh(mesh):
    return _train(model_cfg=model_cfg, train_cfg=train_cfg, optim_cfg=optim_cfg, workdir=workdir,
                  train_iter=train_iter, eval_batches=eval_batches, init_params=init_params, mesh=mesh,
                  rules=rules if rules is not None else ShardingRules(), log_fn=log_fn)


@dataclasses.dataclass
class _Run:
  """What one training run works with once set up: the state, the compiled steps and where batches go."""
  state: step_lib.TrainState
  train_step: Callable
  eval_step: Callable
  put: Callable[[dict], dict]
  checkpointer: ckpt_lib.Checkpointer


def _set_up(model_cfg, train_cfg, optim_cfg, workdir, train_iter, init_params, mesh, rules, log_fn) -> _Run:
  """Shardings, the state (restored from `workdir` with the data iterator, or initialised) and the jitted steps."""
  layout.check_model_params(model_cfg, mesh, rules)
  params_shardings = model.shardings(model_cfg, mesh, rules)
  abstract_params = jax.eval_shape(lambda: model.init(jax.random.key(0), model_cfg))
  optimizer = optim.make_optimizer(optim_cfg, abstract_params)
  shardings = step_lib.state_shardings(optimizer, abstract_params, params_shardings,
                                       rules.mesh_axes("optimizer_state"))
  batch_sharding = layout.batch_sharding(mesh, rules)
  _, shard_count = layout.process_batch_shard(batch_sharding)

  def put(batch):
    rows, length = batch["tokens"].shape
    layout.check_batch_shape(rows * shard_count, length, batch_sharding)
    return layout.global_batch(batch, batch_sharding, shard_count)

  checkpointer = ckpt_lib.Checkpointer(workdir, keep=train_cfg.ckpt_keep)
  if checkpointer.latest_step() is not None:
    abstract_state = jax.eval_shape(lambda: step_lib.init_state(abstract_params, optimizer))
    state = checkpointer.restore(ckpt_lib.abstract_like(abstract_state, shardings), train_iter)
    log_fn(f"Resumed from {checkpointer.directory} at step {int(state.step)}")
  else:
    if init_params is None:
      init_params = model.init(jax.random.key(train_cfg.seed), model_cfg, mesh, rules)
    else:
      init_params = jax.tree.map(_place, init_params, params_shardings)
    init = jax.jit(lambda p: step_lib.init_state(p, optimizer), out_shardings=shardings)
    state = init(init_params)
  return _Run(state, step_lib.make_train_step(model_cfg, train_cfg, optimizer, shardings, batch_sharding, rules),
              step_lib.make_eval_step(model_cfg, params_shardings, batch_sharding), put, checkpointer)


class _Finisher:
  """Host-side end of a step: finiteness check, logging (+ held-out eval), checkpoint — once its metrics are back."""

  def __init__(self, run: _Run, train_cfg: TrainConfig, optim_cfg: OptimConfig, workdir: str, train_iter,
               eval_batches, start: int, primary: bool):
    self.run, self.cfg, self.train_iter, self.eval_batches = run, train_cfg, train_iter, eval_batches
    self.schedule = optim.learning_rate_schedule(optim_cfg)
    self.writer = metrics_lib.MetricWriter(workdir) if primary else None
    self.bar = None
    if train_cfg.progress_bar and primary:
      from tqdm import tqdm
      self.bar = tqdm(total=train_cfg.steps, initial=start, desc="train", dynamic_ncols=True)
    self.last: dict = {}
    self.ppl = math.nan  # the latest held-out perplexity, shown on the bar between evaluations
    self.t_log, self.tokens_since_log = time.perf_counter(), 0.0

  def __call__(self, step_no: int, dev_metrics) -> None:
    cfg, ckpt = self.cfg, self.run.checkpointer
    m = jax.device_get(dev_metrics)
    if not np.isfinite(m["loss"]):
      raise NonFiniteLossError(
          f"Non-finite loss {m['loss']} at step {step_no}; stopping. The last good checkpoint is step "
          f"{ckpt.latest_step()} in {ckpt.directory}.")
    self.tokens_since_log += float(m["target_tokens"])
    if step_no % cfg.log_every == 0 or step_no == cfg.steps:
      self._log(step_no, m)
    if step_no % cfg.ckpt_every == 0 or step_no == cfg.steps:
      ckpt.save(step_no, self.run.state, self.train_iter)

  def _log(self, step_no: int, m) -> None:
    now = time.perf_counter()
    m = {k: float(v) for k, v in m.items()}
    m["tokens_per_s"] = self.tokens_since_log / max(now - self.t_log, 1e-9)
    m["learning_rate"] = float(self.schedule(step_no))
    self.t_log, self.tokens_since_log = now, 0.0
    if step_no % self.cfg.eval_every == 0 or step_no == self.cfg.steps:
      batches = itertools.islice(self.eval_batches(), self.cfg.eval_batches)
      m.update(evaluate(self.run.eval_step, self.run.state.params, batches, self.run.put))
    if self.writer is not None:
      self.writer.write(step_no, m)
    self.last = {"step": step_no, **m}
    if self.bar is not None:
      self.ppl = m.get("eval_perplexity", self.ppl)
      shown = {"loss": f"{m['loss']:.3f}"}
      if math.isfinite(self.ppl):  # SFT without held-out batches has none to show
        shown["ppl"] = f"{self.ppl:.1f}"
      self.bar.set_postfix(shown)

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
    if self.bar is not None:
      self.bar.close()


def _train(*, model_cfg, train_cfg, optim_cfg, workdir, train_iter, eval_batches, init_params, mesh, rules, log_fn):
  primary = distributed.is_primary()
  if not primary:
    log_fn = _discard
  run = _set_up(model_cfg, train_cfg, optim_cfg, workdir, train_iter, init_params, mesh, rules, log_fn)
  start = int(run.state.step)
  first_batch = None
  if jax.process_count() > 1 and start < train_cfg.steps:
    # Processes compile at different speeds, and a gloo (CPU) collective gives a late peer only 30 s: compile both
    # steps ahead of time, then start together.
    first_batch = run.put(next(train_iter))
    run.train_step = run.train_step.lower(run.state, first_batch).compile()
    run.eval_step = run.eval_step.lower(run.state.params, run.put(next(iter(eval_batches())))).compile()
    distributed.barrier("train_steps_compiled")
  finish = _Finisher(run, train_cfg, optim_cfg, workdir, train_iter, eval_batches, start, primary)
  pending = None                                    # (step, metrics on device) of the previous step
  try:
    # Ctrl-C stops a single-process run after the step in flight (processes of a multi-process run would not agree
    # on which step); it checkpoints that step below and raises `interrupt.Interrupted`.
    with interrupt.StopAtStep("training", enabled=jax.process_count() == 1) as stop:
      for step_no in range(start + 1, train_cfg.steps + 1):
        if stop.requested:
          break
        batch, first_batch = (first_batch if first_batch is not None else run.put(next(train_iter))), None
        run.state, metrics = run.train_step(run.state, batch)
        if pending is not None:
          finish(*pending)
        pending = (step_no, metrics)
        # Checkpoint and eval steps need the state of exactly that step: finish them before dispatching more.
        if step_no % train_cfg.ckpt_every == 0 or step_no % train_cfg.eval_every == 0 or step_no == train_cfg.steps:
          finish(*pending)
          pending = None
        if finish.bar is not None:
          finish.bar.update(1)
      if pending is not None:
        finish(*pending)
      done = int(run.state.step)
      if done < train_cfg.steps:   # stopped by Ctrl-C: keep the finished steps (the iterator is at the same place)
        if run.checkpointer.latest_step() != done:
          run.checkpointer.save(done, run.state, train_iter)
        raise interrupt.Interrupted(f"training stopped at step {done} of {train_cfg.steps}, checkpointed in "
                                    f"{run.checkpointer.directory}: rerun the same command to resume")
  finally:
    run.checkpointer.close()
    finish.close()
  return run.state.params, finish.last
