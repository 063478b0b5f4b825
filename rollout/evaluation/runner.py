"""The one evaluation runner: one policy on a task set with k samples per task, resumably, writing per-task results
as JSONL beside the settings that define them. `evaluate_policy` is the entry point for callers outside the
benchmark suite (the RL experiment, `experiments/agent_main.py`, notebooks).

Tasks are cut into fixed chunks of the *full* task list; each chunk's k x tasks episodes are stepped together
(one batched `generate` per step) and its records are appended and fsynced when the chunk finishes. On restart the
finished tasks are read back and skipped, so an interrupted run re-does at most the chunk it was in. The harness
seed of a chunk depends only on its position, so a resumed run samples what an uninterrupted one would have.

A set may grow: rerun with more tasks whose start is the stored set (e.g. `n` procedural tasks raised from 600 to
1,500; their mixes are interleaved, so a prefix is the smaller set) and only the new tasks are run. New tasks that
share a chunk with finished ones are sampled apart from them, so at T > 0 they are another draw from the same
policy than a fresh run's, not the same one.

Settings that define a result (`run_settings`: the policy, a hash of the tasks' content, k, chunking, the harness
configuration except `grade_workers`, `grade_early` and `tool_workers`, active parameters) are stored in `run.json`;
a directory holding results made with other settings is refused, naming each difference, so a resume never mixes
them.

A policy whose engine pins its outputs (`result_key()`, the embedded JAX engine) is kept in the cross-run result
cache when one is configured (`result_cache.py`): evaluated again with the same weights, tasks and settings, its
records are read back instead of rerun.

Per-sample record: solved, pass_fraction, reward, output_tokens, turns, tool_calls, wall_s (the chunk's wall time
divided by its episodes: episodes run batched, so this is the amortised cost per sample), cost (active parameters x
output tokens, the report's inference-cost proxy; 0 for the scripted baselines, which run no model), stop_reason,
grade_error and grade_timed_out (the hidden tests hit their time limit: reported apart from failing tests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence

from rollout import harness
from rollout.engines.protocol import Engine
from rollout.evaluation import atomic, metrics, report, result_cache
from rollout.tasks.environment import TIMEOUT_ERROR, EnvironmentCache
from rollout.tasks.task import Task

RESULTS = "results.jsonl"
RUN_INFO = "run.json"
NOT_RESULT_DEFINING = ("grade_workers", "grade_early", "tool_workers")  # harness fields: speed, not results


@dataclasses.dataclass(frozen=True)
class SampleConfig:
  """samples: k per task; chunk_tasks: tasks per batched chunk (and per checkpoint of progress);
  active_params: parameters used per token, for the cost estimate."""
  samples: int = 1
  chunk_tasks: int = 8
  active_params: int = 0

  def __post_init__(self):
    if self.samples < 1 or self.chunk_tasks < 1 or self.active_params < 0:
      raise ValueError(f"need samples >= 1, chunk_tasks >= 1, active_params >= 0; got {self}")


def set_fingerprint(tasks: Sequence[Task]) -> str:
  """A short hash of the tasks' content in order (a resumed run must see the same tasks, labels included)."""
  return prefix_fingerprints(tasks)[-1] if tasks else hashlib.sha256().hexdigest()[:16]


def prefix_fingerprints(tasks: Sequence[Task]) -> list[str]:
  """`set_fingerprint(tasks[:i + 1])` for each i, in one pass."""
  digest, out = hashlib.sha256(), []
  for t in tasks:
    digest.update(json.dumps(t.to_dict(), sort_keys=True, default=str).encode())
    out.append(digest.hexdigest()[:16])
  return out


def run_settings(policy: str, tasks: Sequence[Task], harness_cfg: harness.HarnessConfig, cfg: SampleConfig) -> dict:
  """The settings that define a run's results (stored in run.json, compared on resume)."""
  h = json.loads(json.dumps(dataclasses.asdict(harness_cfg), default=str))
  for k in NOT_RESULT_DEFINING:
    h.pop(k, None)
  return {"policy": policy, "set": set_fingerprint(tasks), "samples": cfg.samples, "chunk_tasks": cfg.chunk_tasks,
          "active_params": cfg.active_params, "harness": h}


def settings_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
  """'key: old -> new' for every setting that differs (nested keys joined with '.')."""
  out = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k), new.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
      out += settings_diff(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append(f"{prefix}{k}: {a!r} -> {b!r}")
  return out


def read_run_info(out_dir: str) -> dict | None:
  path = os.path.join(out_dir, RUN_INFO)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _write_run_info(out_dir: str, info: dict) -> None:
  atomic.write_text(os.path.join(out_dir, RUN_INFO), json.dumps(info, indent=1))


def _check_run_info(out_dir: str, info: dict, tasks: Sequence[Task], log: Callable[[str], None]) -> None:
  """Stores `info` in a new `out_dir`; refuses one whose results were made with other settings, except a set that
  grew (the stored set is a start of `tasks`: its results stay valid, and run.json then names the bigger set)."""
  old = read_run_info(out_dir)
  if old is None:
    _write_run_info(out_dir, info)
    return
  if old.get("set") != info["set"] and settings_diff({**old, "set": info["set"]}, info) == []:
    prefixes = prefix_fingerprints(tasks)
    if old.get("set") in prefixes[:-1]:
      log(f"[{info['policy']}] the set grew from {prefixes.index(old['set']) + 1} to {len(tasks)} tasks: "
          "only the new ones are run")
      _write_run_info(out_dir, info)
      return
  diff = [("the tasks differ (other tasks, contents or labels)" if d.startswith("set: ") else d)
          for d in settings_diff(old, info)]
  if diff:
    raise ValueError(f"{out_dir} holds results made with other settings (stored -> now): {'; '.join(diff[:8])}. "
                     "Resuming would mix them: use a new output directory (or delete this one).")


def read_records(out_dir: str) -> dict[str, dict]:
  """Task id -> record of the tasks already finished in `out_dir` (a torn last line from a kill is ignored)."""
  path = os.path.join(out_dir, RESULTS)
  done = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          rec = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut by an interruption; its chunk is re-run
        done[rec["task_id"]] = rec
  return done


def _sample(traj, wall_s: float, active_params: int) -> dict:
  m = traj.metrics
  error = m.get("grade_error", "")
  return {"solved": float(m["solved"]), "pass_fraction": float(m["pass_fraction"]), "reward": float(traj.reward),
          "output_tokens": int(m["output_tokens"]), "turns": int(m["turns"]), "tool_calls": int(m["tool_calls"]),
          "wall_s": wall_s, "cost": float(active_params) * int(m["output_tokens"]), "stop_reason": traj.stop_reason,
          "grade_error": error, "grade_timed_out": error.startswith(TIMEOUT_ERROR)}


def _append(out_dir: str, records: list[dict]) -> None:
  with open(os.path.join(out_dir, RESULTS), "a", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
    f.flush()
    os.fsync(f.fileno())


def run_policy(policy: str, engine: Engine, tokenizer, tasks: Sequence[Task], envs: EnvironmentCache,
               harness_cfg: harness.HarnessConfig, out_dir: str, cfg: SampleConfig = SampleConfig(),
               log: Callable[[str], None] = print, on_chunk: Callable[[list], None] | None = None,
               cache_dir: str | None = None) -> list[dict]:
  """Evaluates `engine` on `tasks`, resuming from `out_dir`.

  Args:
    policy: a name recorded with each result.
    engine: anything implementing the engine protocol.
    tokenizer: the tokenizer the engine speaks.
    tasks: the (validated) task set.
    envs: environment cache.
    harness_cfg: harness limits and sampling; its seed is the base seed.
    out_dir: where results.jsonl and run.json go (created).
    cfg: k, chunking, active parameters.
    log: progress lines.
    on_chunk: called with each chunk's trajectories (e.g. to print transcripts; not for results read back from
      the result cache).
    cache_dir: the cross-run result cache (`result_cache.py`; None: `$COMPOSER_JAX_EVAL_CACHE`, '' or unset: off).

  Returns:
    One record per task in task order: {task_id, policy, samples: [per-sample dict]}.
  """
  if len({t.id for t in tasks}) != len(tasks):
    raise ValueError("task ids must be unique within a set")
  os.makedirs(out_dir, exist_ok=True)
  settings = run_settings(policy, tasks, harness_cfg, cfg)
  _check_run_info(out_dir, settings, tasks, log)
  done = read_records(out_dir)
  store = result_cache.root(cache_dir)
  key = result_cache.cache_key(engine, tokenizer, settings) if store else None
  if key and not done:
    cached = result_cache.load(store, key, policy)
    if cached is not None and [r["task_id"] for r in cached] == [t.id for t in tasks]:
      _append(out_dir, cached)
      log(f"[{policy}] all {len(cached)} tasks read from the result cache (same weights, tasks and settings)")
      return cached
  if done:
    log(f"[{policy}] resuming: {len(done)}/{len(tasks)} tasks already done")
  for c0 in range(0, len(tasks), cfg.chunk_tasks):
    chunk = [t for t in tasks[c0:c0 + cfg.chunk_tasks] if t.id not in done]
    if not chunk:
      continue
    episodes = [t for t in chunk for _ in range(cfg.samples)]
    seeded = dataclasses.replace(harness_cfg, seed=harness_cfg.seed * 1_000_003 + c0)
    t0 = time.perf_counter()
    trajs = harness.run_episodes(engine, tokenizer, episodes, envs, seeded)
    wall = (time.perf_counter() - t0) / len(episodes)
    if on_chunk is not None:
      on_chunk(trajs)
    recs = [{"task_id": t.id, "policy": policy,
             "samples": [_sample(tr, wall, cfg.active_params) for tr in trajs[i * cfg.samples:(i + 1) * cfg.samples]]}
            for i, t in enumerate(chunk)]
    _append(out_dir, recs)
    done.update((r["task_id"], r) for r in recs)
    solved = sum(s["solved"] for r in recs for s in r["samples"])
    timeouts = sum(s["grade_timed_out"] for r in recs for s in r["samples"])
    log(f"[{policy}] tasks {c0}-{c0 + len(tasks[c0:c0 + cfg.chunk_tasks]) - 1}: {solved:.0f}/{len(episodes)} "
        f"samples solved" + (f", {timeouts} grading timeouts" if timeouts else "") +
        f", {wall:.2f} s/sample; {len(done)}/{len(tasks)} done")
  records = [done[t.id] for t in tasks]
  if key:
    result_cache.save(store, key, records)
  return records


def evaluate_policy(policy: str, engine: Engine, tokenizer, tasks: Sequence[Task], envs: EnvironmentCache,
                    harness_cfg: harness.HarnessConfig, out_dir: str | None = None, cfg: SampleConfig = SampleConfig(),
                    transcripts: int = 0, log: Callable[[str], None] = print) -> dict[str, float]:
  """Runs one policy on `tasks` and returns its metrics: the entry point for code outside the benchmark suite.

  Args:
    policy: its name (recorded with the results).
    engine, tokenizer: the policy.
    tasks: the tasks (e.g. `rollout.tasks.registry.load_tasks(spec, envs)`).
    envs: environment cache.
    harness_cfg: the agent loop's settings (sampling temperature included).
    out_dir: results go here and a rerun resumes (settings checked); None: a temporary directory, no resume.
    cfg: k samples per task, chunking, active parameters (cost).
    transcripts: how many readable transcripts to log (from the first chunk run).
    log: progress lines.

  Returns:
    `metrics.summarize` of the records: n_tasks, samples_per_task, pass@1 and its 95% interval (pass@1_lo/_hi),
    pass@k, grade_timeouts and per-sample means (reward, output_tokens, turns, tool_calls, wall_s, cost).
  """
  shown = []

  def show(trajs):
    for t in trajs[:max(0, transcripts - len(shown))]:
      shown.append(t)
      log(report.format_transcript(t))

  if out_dir is None:
    with tempfile.TemporaryDirectory(prefix="eval_") as tmp:
      recs = run_policy(policy, engine, tokenizer, tasks, envs, harness_cfg, tmp, cfg, log, show)
  else:
    recs = run_policy(policy, engine, tokenizer, tasks, envs, harness_cfg, out_dir, cfg, log, show)
  summary = metrics.summarize(recs, ks=(cfg.samples,))
  log(f"[{policy}] " + " ".join(f"{k}={v:.3f}" for k, v in summary.items()))
  return summary
