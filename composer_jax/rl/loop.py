"""The RL trainer: warm start, rollout workers, the queue, the jitted RL step, publishing and checkpoints.

`train_rl(cfg)` runs one RL job in `cfg.workdir`:
  1. tokenizer and the SFT warm start on oracle transcripts (`warmstart`): from random init with a tokenizer
     fitted on training tasks, or from `init_checkpoint` (a finished pretraining/SFT stage, with its tokenizer);
     `sft_steps=0` starts RL from the checkpoint as it is. The start is also the frozen KL reference.
  2. state: restored from `workdir/checkpoints` (params, optimizer, step + the queue consumer's cursor, saved in the
     same orbax checkpoint) or initialised from the warm start.
  3. per step: get `groups_per_step` whole groups from the tensorstore queue (sync: roll them out in-process with
     the current weights first; async: the worker processes fill the queue while the previous step trains), build
     the fixed-shape batch, run the RL step, log, publish weights every `publish_every`, checkpoint every
     `ckpt_every` (then GC the queue up to the saved cursor).

Exactly once: `applied.jsonl` records which group keys each step trained on. On restore at step s, lines after s
are dropped (those steps are redone, and the restored cursor re-delivers exactly their groups).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from composer_jax import model
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import publish, setup, warmstart
from composer_jax.rl import step as rl_step
from composer_jax.rl.config import RunConfig
from composer_jax.train import loop as train_loop
from composer_jax.train import metrics as metrics_lib
from composer_jax.train import optim, stages
from composer_jax.train import step as step_lib
from composer_jax.train import tokenizer as tokenizer_lib
from rollout import workers
from rollout.queue import QueueConsumer, QueueProducer
from rollout.staleness import StalenessConfig


def queue_url(cfg: RunConfig) -> str:
  return f"file://{os.path.join(os.path.abspath(cfg.workdir), 'queue')}"


def warm_start(cfg: RunConfig, log_fn: Callable[[str], None] = print):
  """Tokenizer in `workdir/tokenizer` and the starting params (SFT on oracle transcripts from random init or from
  `init_checkpoint`; with `sft_steps=0`, the checkpoint itself)."""
  tok_dir = setup.tokenizer_dir(cfg)
  if cfg.sft.init_checkpoint:
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
      tok = tokenizer_lib.load_tokenizer(os.path.join(cfg.sft.init_checkpoint, "tokenizer"))
      tokenizer_lib.save_tokenizer(tok, tok_dir)
    if not cfg.sft.steps:
      return stages.load_params(cfg.sft.init_checkpoint, cfg.model)
  sft_dir = os.path.join(cfg.workdir, "sft")
  pool = setup.train_pool(cfg)
  if os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
    tok = tokenizer_lib.load_tokenizer(tok_dir)
  else:
    tok = warmstart.fit_tokenizer(pool[:max(cfg.sft.tasks, 256)], cfg.harness.system_prompt,
                                  cfg.tokenizer.vocab_size)
    tokenizer_lib.save_tokenizer(tok, tok_dir)
  if os.path.isdir(os.path.join(sft_dir, "params")):
    return stages.load_params(sft_dir, cfg.model)
  init_params = stages.load_params(cfg.sft.init_checkpoint, cfg.model) if cfg.sft.init_checkpoint else None
  sft, dev = setup.sft_transcripts(cfg, tok, pool)
  log_fn(f"SFT warm start: {len(sft)} oracle transcripts, {cfg.sft.steps} steps")
  params, last = warmstart.run_sft(cfg.model, tok, sft, dev, sft_dir, steps=cfg.sft.steps,
                                   seq_len=cfg.sft.seq_len, batch_size=cfg.sft.batch,
                                   learning_rate=cfg.sft.learning_rate, seed=cfg.seed, init_params=init_params,
                                   log_fn=log_fn)
  log_fn(f"SFT done: loss {last.get('loss', float('nan')):.3f} eval_loss {last.get('eval_loss', float('nan')):.3f}")
  return params


class _Checkpoints:
  """orbax checkpoints of (TrainState, queue consumer state) saved together."""

  def __init__(self, workdir: str):
    self.mgr = ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "queue": ocp.JsonCheckpointHandler()})

  def latest_step(self):
    return self.mgr.latest_step()

  def save(self, step: int, state, qstate: dict) -> None:
    self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                queue=ocp.args.JsonSave(qstate)), force=True)
    self.mgr.wait_until_finished()

  def restore(self, abstract_state):
    r = self.mgr.restore(self.mgr.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), queue=ocp.args.JsonRestore()))
    return r["state"], r["queue"]


def _truncate_applied(path: str, step: int) -> None:
  if not os.path.exists(path):
    return
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  with open(path + ".tmp", "w") as f:
    for r in rows:
      if r["step"] <= step:
        f.write(json.dumps(r) + "\n")
  os.replace(path + ".tmp", path)


class _WorkerPool:
  """Worker processes, restarted if one dies (its unfinished group is redone; nothing queued is lost)."""

  def __init__(self, cfg: RunConfig, log_fn):
    self.cfg, self.log_fn = cfg, log_fn
    self.logs = os.path.join(cfg.workdir, "workers")
    os.makedirs(self.logs, exist_ok=True)
    stop = os.path.join(self.logs, "STOP")
    if os.path.exists(stop):
      os.remove(stop)
    self.procs = [self._start(i) for i in range(cfg.rollout.workers)]
    self.restarts = 0

  def _start(self, i: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    out = open(os.path.join(self.logs, f"worker{i}.log"), "a")
    return subprocess.Popen([sys.executable, "-m", "composer_jax.rl.worker", self.cfg.workdir, str(i)],
                            stdout=out, stderr=subprocess.STDOUT, env=env)

  def check(self) -> None:
    for i, p in enumerate(self.procs):
      if p.poll() is not None:
        self.log_fn(f"worker{i} exited with {p.returncode}; restarting it (see {self.logs}/worker{i}.log)")
        self.restarts += 1
        if self.restarts > 10 * self.cfg.rollout.workers:
          raise RuntimeError(f"workers keep dying; see {self.logs}/worker*.log")
        self.procs[i] = self._start(i)

  def close(self) -> None:
    open(os.path.join(self.logs, "STOP"), "w").close()
    for p in self.procs:
      p.terminate()
    for p in self.procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        p.kill()


def train_rl(cfg: RunConfig, log_fn: Callable[[str], None] = print) -> dict:
  """Runs (or resumes) the RL job of `cfg` to `cfg.train.steps`; returns the final params and the last metrics."""
  setup.save_run_config(cfg)
  init_params = warm_start(cfg, log_fn)
  ref_params = init_params
  tok = setup.load_tokenizer(cfg)
  mesh = train_loop.single_device_mesh()
  params_sh = model.shardings(cfg.model, mesh)
  abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), cfg.model))
  optimizer = rl_step.freeze_subtrees(optim.make_optimizer(cfg.train.optim, abstract), abstract)
  state_sh = train_loop.state_shardings(optimizer, abstract, params_sh, cfg.seed)
  ckpts = _Checkpoints(cfg.workdir)
  applied_path = os.path.join(cfg.workdir, "applied.jsonl")
  if ckpts.latest_step() is not None:
    abstract_state = jax.eval_shape(lambda: step_lib.init_state(abstract, optimizer, cfg.seed))
    from composer_jax.train import checkpoint as ckpt_lib
    state, qstate = ckpts.restore(ckpt_lib.abstract_like(abstract_state, state_sh))
    log_fn(f"Resumed RL at step {int(state.step)}")
  else:
    state = jax.jit(lambda p: step_lib.init_state(p, optimizer, cfg.seed), out_shardings=state_sh)(init_params)
    qstate = None
  start = int(state.step)
  _truncate_applied(applied_path, start)
  consumer = QueueConsumer(queue_url(cfg), StalenessConfig(cfg.rollout.max_staleness, cfg.rollout.staleness_policy),
                           state=qstate)
  bcfg = rl_batch.BatchConfig(rows=cfg.batch_rows, length=cfg.harness.context_budget,
                              n_moe_layers=cfg.model.num_hidden_layers - cfg.model.first_k_dense_replace,
                              top_k=cfg.model.num_experts_per_tok)
  batch_sh = rl_step.batch_shardings(mesh)
  step_fn = rl_step.make_rl_step(cfg.model, cfg.rl, optimizer, state_sh, batch_sh, params_sh)
  wdir = os.path.join(cfg.workdir, "weights")
  fleet = None
  if cfg.rollout.engine == "sglang":
    from composer_jax.rl import fleet as fleet_lib
    fleet = fleet_lib.FleetPublisher(cfg, state.params, start, log_fn)   # before the workers: they attach to it
  else:
    got = publish.latest(wdir)
    if got is None or got[0] != start:
      publish.publish(wdir, state.params, start)

  writer = metrics_lib.MetricWriter(cfg.workdir)
  pool = sync_engine = sync_envs = None
  if cfg.rollout.mode == "async":
    pool = _WorkerPool(cfg, log_fn)
  else:
    if fleet is not None:
      sync_engine = fleet.fleet
    else:
      from composer_jax.rl.worker import engine_config
      from composer_jax.sampling.engine import JaxEngine
      sync_engine = JaxEngine(state.params, cfg.model, engine_config(cfg), policy_version=start)
    sync_envs = setup.make_envs(cfg)
    producer = QueueProducer(queue_url(cfg), "sync0")
    task_pool = setup.train_pool(cfg)
    wcfg = workers.WorkerConfig(samples_per_prompt=cfg.rollout.samples_per_prompt, max_groups=cfg.train.groups_per_step)
  bar = None
  if cfg.progress_bar:
    from tqdm import tqdm
    bar = tqdm(total=cfg.train.steps, initial=start, desc="rl", dynamic_ncols=True)
  last: dict = {}
  try:
    for step_no in range(start + 1, cfg.train.steps + 1):
      t0 = time.perf_counter()
      version = step_no - 1
      rollout_s = 0.0
      publish_s = 0.0
      if sync_engine is not None:
        if fleet is None:
          sync_engine.update_weights(state.params, version)
        elif fleet.fleet.policy_version != version:
          publish_s = fleet.publish(state.params, version)
        workers.run_worker(sync_engine, tok, task_pool, sync_envs, cfg.harness, producer, wcfg,
                           os.path.join(cfg.workdir, "sync0.json"))
        rollout_s = time.perf_counter() - t0
      groups, rows, t_wait = [], 0, time.perf_counter()
      while len(groups) < cfg.train.groups_per_step:
        got = consumer.poll(version, max_groups=cfg.train.groups_per_step - len(groups), max_rows=cfg.batch_rows - rows)
        groups += got
        rows += sum(g.key.n_rows for g in got)
        if len(groups) < cfg.train.groups_per_step:
          if pool is not None:
            pool.check()
          time.sleep(0.05)
      idle_s = time.perf_counter() - t_wait + rollout_s
      batch = rl_batch.from_consumed(groups, bcfg)
      t_train = time.perf_counter()
      state, m = step_fn(state, jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, batch_sh),
                         ref_params)
      m = {k: float(v) for k, v in jax.device_get(m).items()}
      if not np.isfinite(m["loss"]):
        raise train_loop.NonFiniteLossError(f"non-finite RL loss at step {step_no}; last good checkpoint "
                                            f"{ckpts.latest_step()}")
      train_s = time.perf_counter() - t_train
      with open(applied_path, "a") as f:
        f.write(json.dumps({"step": step_no, "keys": [g.key.key for g in groups]}) + "\n")
      if step_no % cfg.rollout.publish_every == 0 and pool is not None:
        if fleet is not None:
          publish_s = fleet.publish(state.params, step_no)
        else:
          publish.publish(wdir, state.params, step_no)
      qs = consumer.stats()
      hist = qs.pop("staleness_hist")
      m.update({k: float(v) for k, v in qs.items()})
      m.update({f"staleness_{k}": float(v) for k, v in hist.items()})
      step_s = time.perf_counter() - t0
      m.update(step_s=step_s, trainer_idle_s=idle_s, trainer_idle_fraction=idle_s / max(step_s, 1e-9),
               train_s=train_s, rollout_s=rollout_s, publish_s=publish_s)
      writer.write(step_no, m)
      last = {"step": step_no, **m}
      if bar is not None:
        bar.update(1)
        bar.set_postfix(reward=f"{m['reward']:.2f}", pass_rate=f"{m['pass_rate']:.2f}", kl=f"{m['kl']:.3f}")
      else:
        log_fn(f"step {step_no}: reward {m['reward']:.3f} pass {m['pass_rate']:.2f} kl {m['kl']:.4f} "
               f"idle {idle_s:.2f}s/{step_s:.2f}s")
      if step_no % cfg.train.ckpt_every == 0 or step_no == cfg.train.steps:
        qsave = consumer.state()
        ckpts.save(step_no, state, qsave)
        consumer.commit(qsave)      # GC only what a finished checkpoint no longer needs
  finally:
    writer.close()
    if bar is not None:
      bar.close()
    if pool is not None:
      pool.close()
    if sync_envs is not None:
      sync_envs.factory.close()
    if fleet is not None:
      fleet.close()
  _plot(cfg.workdir)
  return {"params": state.params, "ref_params": ref_params, "last": last}


def _plot(workdir: str) -> None:
  try:
    metrics_lib.plot_metrics(os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "reward.png"),
                             ("reward", "pass_rate"), title="RL reward and pass rate per step", smooth=10)
  except Exception as e:  # noqa: BLE001 - a missing matplotlib must not fail a finished run
    print(f"(no reward plot: {e})")


def replace(cfg: RunConfig, **kw) -> RunConfig:
  return dataclasses.replace(cfg, **kw)


if __name__ == "__main__":
  # `python -m composer_jax.rl.loop <workdir>`: (re)start the trainer of a run whose RunConfig is in the workdir.
  train_rl(setup.load_run_config(sys.argv[1]))
