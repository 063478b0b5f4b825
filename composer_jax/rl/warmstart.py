"""The RL starting point: SFT on oracle trajectories, in the run's tokenizer (`setup.run_tokenizer`).

`warm_start(plan, run)` is the whole step: SFT from random init or from `sft.init_checkpoint` (`sft.steps=0`: the
checkpoint as it is). The start is also RL's frozen KL reference.

Oracle transcripts are produced by running the scripted oracle through the real harness (same prompts, tool
results and chat format the policy will see), written as JSONL, and trained on with the LM trainer's SFT data path
(loss on assistant tokens only). A task's oracle is its scripted one (procedural tasks) or, where it has none
(mined, SWE-style), "apply the gold patch" through the agent's own tools. Held-out tasks never enter the tokenizer
or the SFT data.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Callable, Sequence

import jax
import tqdm

from composer_jax.model.config import ModelConfig
from composer_jax.parallel import distributed, layout
from composer_jax.parallel.rules import ShardingRules
from composer_jax.rl import processes, setup
from composer_jax.rl.config import SFTPlan
from composer_jax.train import data as data_lib
from composer_jax.train import loop as train_loop
from composer_jax.train import stages
from composer_jax.train import tokenizer as tokenizer_lib
from composer_jax.train.config import OptimConfig, TrainConfig
from rollout import harness
from rollout.engines import scripted
from rollout.evaluation import policies
from rollout.tasks import procedural


def oracle_transcripts(tokenizer, tasks: Sequence, envs, hcfg: harness.HarnessConfig, progress: bool = False,
                       chunk: int = 64) -> list[list[dict]]:
  """The oracle's transcripts through the harness (a task's own oracle, else its gold patch applied), one per
  segment: a self-summarising chain gives one transcript per context (`harness.segment_transcripts`).

  Episodes run `chunk` tasks at a time (episodes are independent), so `progress` can show a bar: a colab start's
  1,024 sandboxed episodes take minutes. Raises if the oracle fails a task (a broken grader); tasks marked
  `near_miss` carry a deliberately wrong demonstration and are not checked.
  """
  # Demonstrations are summary chains even for the drop-oldest ablation: the scripted oracle keeps its place through
  # its summaries (dropped turns would lose it), and the ablation changes what RL and evaluation do, not the start.
  hcfg = dataclasses.replace(hcfg, overflow="summarize")
  tasks, trajs = list(tasks), []
  with tqdm.tqdm(total=len(tasks), desc="oracle demonstrations", dynamic_ncols=True, disable=not progress) as bar:
    for i in range(0, len(tasks), chunk):
      part = tasks[i:i + chunk]
      trajs += harness.run_episodes(scripted.ScriptedEngine(tokenizer, policies.oracle_policy(part)), tokenizer,
                                    part, envs, hcfg)
      bar.update(len(part))
  bad = [t.task_id for t, task in zip(trajs, tasks, strict=True)
         if not t.metrics.get("solved") and not task.metadata.get("near_miss")]
  if bad:
    raise RuntimeError(f"the oracle failed {len(bad)} tasks (e.g. {bad[:3]}): check the sandbox/grader")
  return [seg for t in trajs for seg in harness.segment_transcripts(t.messages)]


def write_jsonl(path: str, transcripts: Sequence[Sequence[dict]]) -> None:
  """Writes atomically: a resumed SFT reads back its demonstrations (`train.data.read_transcripts`) only when they
  were written whole."""
  with open(path + ".tmp", "w") as f:
    for m in transcripts:
      f.write(json.dumps({"messages": list(m)}) + "\n")
  os.replace(path + ".tmp", path)


def run_sft(model_cfg: ModelConfig, tokenizer, train: Sequence, heldout: Sequence, workdir: str, *, steps: int,
            seq_len: int, batch_size: int, learning_rate: float, seed: int = 0, init_params=None,
            progress_bar: bool = False, log_fn: Callable[[str], None] = print, mesh=None, rules=None):
  """SFT on transcripts in `workdir` from `init_params` (params, a directory of exported params loaded here, or
  None: a random init); exports `workdir/params` and returns the params and last metrics.

  On `mesh` under `rules` (default: one device); across processes, process 0 writes the files and each process
  trains on its rows of each global batch. Resumable: it checkpoints every tenth of its steps (at most every 100),
  and Ctrl-C checkpoints the steps done (`train.interrupt`), so an interrupted SFT continues from there, with its
  data iterator where it was."""
  tr, ev = os.path.join(workdir, "sft_train.jsonl"), os.path.join(workdir, "sft_eval.jsonl")

  def write():
    os.makedirs(workdir, exist_ok=True)
    tokenizer_lib.save_tokenizer(tokenizer, os.path.join(workdir, "tokenizer"))
    write_jsonl(tr, train)
    write_jsonl(ev, heldout)
  processes.on_primary("sft_files", write)
  dcfg = data_lib.DataConfig(seq_len=seq_len, batch_size=batch_size, seed=seed)
  mesh = mesh if mesh is not None else train_loop.single_device_mesh()
  data = _process_rows(data_lib.sft_data(tokenizer, tr, ev, dcfg), dcfg,
                       layout.batch_sharding(mesh, rules if rules is not None else ShardingRules()))
  tcfg = TrainConfig(steps=steps, seed=seed, log_every=max(1, steps // 10), eval_every=steps, eval_batches=2,
                     ckpt_every=max(1, min(100, steps // 10)), ckpt_keep=1,
                     # A model with MTP modules gets its drafter trained too (self-distilled, the trunk detached:
                     # the trunk's training is the one without MTP), so speculative rollouts start from one.
                     mtp_loss="self_distill" if model_cfg.num_nextn_predict_layers else "none", mtp_weight=0.3,
                     bias_update_rate=1e-3, progress_bar=progress_bar)
  ocfg = OptimConfig(learning_rate=learning_rate, warmup_steps=max(1, steps // 10), decay_steps=steps)
  if isinstance(init_params, str):   # a finished stage's (or checkpoint's) exported params, onto the mesh it trains on
    init_params = stages.load_params(init_params, model_cfg, mesh, rules)
  params, last = train_loop.train(model_cfg=model_cfg, train_cfg=tcfg, optim_cfg=ocfg, workdir=workdir,
                                  train_iter=iter(data.train), eval_batches=lambda: iter(data.eval),
                                  init_params=init_params, mesh=mesh, rules=rules, log_fn=log_fn)
  stages.export_params(workdir, params)
  return params, last


def _process_rows(data: data_lib.Data, dcfg: data_lib.DataConfig, sharding) -> data_lib.Data:
  """`data` (global batches) cut to this process's rows of each batch (`layout.process_batch_shard`): every process
  packs all the transcripts (a few thousand) and keeps its block, so a step's global batch is the one a single
  process trains on, whatever the process count (pretraining's shards of the examples would pack differently)."""
  layout.check_batch_shape(dcfg.batch_size, dcfg.seq_len, sharding)
  index, count = layout.process_batch_shard(sharding)
  if count == 1:
    return data
  n = dcfg.batch_size // count
  rows = lambda b: {k: v[index * n:(index + 1) * n] for k, v in b.items()}   # noqa: E731
  return dataclasses.replace(data, train=data.train.map(rows), eval=data.eval.map(rows))


def sft_tasks(plan: SFTPlan, pool: list) -> list:
  """The SFT tasks: the end of the pool (the workers' streams start at its beginning), a `1 - sft.demo_accuracy`
  share of them (chosen by the run's seed) with near-miss demonstrations (`procedural.near_miss`)."""
  rng = random.Random(f"near-miss/{plan.seed}")
  return [procedural.near_miss(t, rng) if rng.random() >= plan.sft.demo_accuracy else t
          for t in pool[-plan.sft.tasks:]]


def sft_transcripts(plan: SFTPlan, run: setup.Run, keep: Callable[[object], bool] | None = None) -> tuple[list, list]:
  """Demonstration transcripts for SFT (`sft_tasks`) and the dev transcripts of `run.dev` (right fixes); with
  `keep` (a procedural level -> bool), only the tasks of the levels it keeps (a curriculum's part).

  A small finite set may have no held-out side; then the dev loss is measured on two training demonstrations
  (it only monitors SFT, and says so in the log).
  """
  pick = (lambda ts: ts) if keep is None else (lambda ts: [t for t in ts if keep(t.metadata.get("level"))])
  tasks = pick(sft_tasks(plan, run.pool))
  train = oracle_transcripts(run.tokenizer, tasks, run.envs, plan.harness, progress=run.progress_bar)
  dev_tasks = pick(run.dev)
  if not dev_tasks:
    print("(no held-out tasks: SFT dev loss on 2 training demonstrations)")
    return train, train[:2]
  return train, oracle_transcripts(run.tokenizer, dev_tasks, run.envs, plan.harness)


CURRICULUM_DIR = "sft_curriculum"   # a curriculum's first stage, beside the warm start's `sft`


def _saved(workdir: str) -> list[str]:
  return [os.path.join(workdir, f) for f in ("sft_train.jsonl", "sft_eval.jsonl")]


def sft(plan: SFTPlan, run: setup.Run, init_params, workdir: str, *, steps: int, learning_rate: float, seed: int,
        keep: Callable[[object], bool] | None = None, log_fn: Callable[[str], None] = print):
  """SFT of the run's model on its demonstrations in `workdir` (a warm start's stage, or the equal-time control)
  from `init_params` (as `run_sft` takes them); with `keep`, on those of the procedural levels it keeps (a
  curriculum's first stage).

  Demonstrations are made once per task (re-running thousands of sandboxed episodes would only cost time): a
  resumed stage reads its own back, the control reads the warm start's (`run.workdir/sft`), and the warm start
  after a curriculum reads the first stage's and adds the other levels'."""
  warm, first = os.path.join(run.workdir, "sft"), os.path.join(run.workdir, CURRICULUM_DIR)

  def make():
    if all(map(os.path.isfile, _saved(workdir))):   # resumed: this stage's demonstrations are already made
      return tuple(map(data_lib.read_transcripts, _saved(workdir)))
    if keep is None and os.path.abspath(workdir) != os.path.abspath(warm) and all(map(os.path.isfile, _saved(warm))):
      return tuple(map(data_lib.read_transcripts, _saved(warm)))
    if keep is None and plan.sft.curriculum_levels and all(map(os.path.isfile, _saved(first))):
      first_train, first_dev = map(data_lib.read_transcripts, _saved(first))
      more, more_dev = sft_transcripts(plan, run, lambda level: level not in plan.sft.curriculum_levels)
      return first_train + more, first_dev + more_dev
    return sft_transcripts(plan, run, keep)
  train, dev = _demonstrations(workdir, make)
  return _train(plan, run, train, dev, workdir, steps, learning_rate, seed, init_params, log_fn)


def _demonstrations(workdir: str, make: Callable[[], tuple[list, list]]) -> tuple[list, list]:
  """`make()`'s (train, dev) transcripts. Across processes process 0 makes them (its sandboxes run the oracle) and
  writes them into `workdir`, where the others read them."""
  def made():
    train, dev = make()
    if jax.process_count() > 1:
      os.makedirs(workdir, exist_ok=True)
      for path, transcripts in zip(_saved(workdir), (train, dev), strict=True):
        write_jsonl(path, transcripts)
    return train, dev
  got = processes.on_primary("demonstrations", made)
  return got if distributed.is_primary() else tuple(map(data_lib.read_transcripts, _saved(workdir)))


TRAIN_SECONDS = "train_seconds.json"   # in each SFT dir: its steps and their wall-clock, demonstrations excluded


def _train(plan: SFTPlan, run: setup.Run, train, dev, workdir: str, steps: int, learning_rate: float, seed: int,
           init_params, log_fn: Callable[[str], None]):
  """`run_sft` with the run's SFT shapes, logging what it trains on and recording how long its steps took
  (workdir/train_seconds.json; a resumed SFT records the steps it ran itself and their time)."""
  log_fn(f"SFT in {workdir}: {len(train)} oracle transcripts, {steps} steps")
  before = _checkpointed_step(workdir)
  t = time.perf_counter()
  out = run_sft(plan.model, run.tokenizer, train, dev, workdir, steps=steps, seq_len=plan.sft.seq_len,
                batch_size=plan.sft.batch, learning_rate=learning_rate, seed=seed, init_params=init_params,
                progress_bar=run.progress_bar, log_fn=log_fn, mesh=run.mesh,
                rules=run.rules)
  if distributed.is_primary():
    os.makedirs(workdir, exist_ok=True)   # the record's own dir (run_sft makes it too)
    with open(os.path.join(workdir, TRAIN_SECONDS), "w") as f:
      json.dump({"steps": steps - before, "seconds": time.perf_counter() - t}, f)
  return out


def _checkpointed_step(workdir: str) -> int:
  """The step of the newest finished SFT checkpoint in `workdir` (orbax names them by step), 0 if none."""
  ckpts = os.path.join(workdir, "checkpoints")
  steps = [int(d) for d in os.listdir(ckpts) if d.isdigit()] if os.path.isdir(ckpts) else []
  return max(steps, default=0)


def seconds_per_step(workdir: str) -> float:
  """The warm start's wall-clock per SFT step: its stages' (workdir/sft_curriculum, workdir/sft) recorded training
  time over their steps. Making the demonstrations (thousands of sandboxed oracle episodes) is not in it: the
  equal-time control reads the start's demonstrations, so its wall-clock is training steps only."""
  records = []
  for stage in (CURRICULUM_DIR, "sft"):
    path = os.path.join(workdir, stage, TRAIN_SECONDS)
    if os.path.isfile(path):
      with open(path) as f:
        records.append(json.load(f))
  if not any(r["steps"] for r in records):
    raise ValueError(f"{os.path.join(workdir, 'sft', TRAIN_SECONDS)} is missing: the warm start's SFT step time was "
                     "not recorded (a start copied from a run before it was), so the equal-time control cannot be "
                     "sized; copy that run's record too, or write sft_control@<RL steps>/control.json by hand")
  return sum(r["seconds"] for r in records) / sum(r["steps"] for r in records)


def sft_stages(plan: SFTPlan, workdir: str) -> list[tuple[str, int, Callable[[object], bool] | None]]:
  """The warm start's SFT stages in order, as (dir, steps, the levels it keeps or None for all): with a curriculum,
  first `sft.curriculum_steps` steps on the demonstrations of `sft.curriculum_levels` only (workdir/sft_curriculum),
  then `sft.steps` on every level's (workdir/sft). Measured (experiments/results/curriculum.md): with level 1 first
  and a BPE fitted to level 1, level 2's start reached 56-78% greedy, where the same steps on the mix from the start
  left it at ~15%."""
  last = (os.path.join(workdir, "sft"), plan.sft.steps, None)
  levels = plan.sft.curriculum_levels
  if not levels:
    return [last]
  return [(os.path.join(workdir, CURRICULUM_DIR), plan.sft.curriculum_steps, lambda level: level in levels), last]


def warm_start(plan: SFTPlan, run: setup.Run, log_fn: Callable[[str], None] = print):
  """The starting params: `sft.init_checkpoint`'s (or a random init) trained through each SFT stage in turn; a
  finished stage is not redone: the next one starts from its exported params, and with every stage finished (or
  `sft.steps=0`, the checkpoint as it is) they are the start. Exported params are loaded on the run's mesh, where
  SFT trains (`run_sft`)."""
  todo = sft_stages(plan, run.workdir) if plan.sft.steps else []
  finished = [i for i, (stage, _, _) in enumerate(todo) if os.path.isdir(os.path.join(stage, "params"))]
  start = plan.sft.init_checkpoint or None   # where the params to start from are exported (None: a random init)
  if finished:
    start = todo[finished[-1]][0]
    todo = todo[finished[-1] + 1:]
  params, last = start, None
  for stage, steps, keep in todo:
    if keep is not None:
      log_fn(f"SFT curriculum: levels {list(plan.sft.curriculum_levels)} first")
    params, last = sft(plan, run, params, stage, steps=steps, learning_rate=plan.sft.learning_rate, seed=plan.seed,
                       keep=keep, log_fn=log_fn)
  if last is not None:
    log_fn(f"SFT done: loss {last.get('loss', float('nan')):.3f} eval_loss {last.get('eval_loss', float('nan')):.3f}")
  if not todo and start:   # nothing left to train: the start is the last finished stage's (or the checkpoint's)
    params = stages.load_params(start, plan.model, run.mesh, run.rules)
  return params
