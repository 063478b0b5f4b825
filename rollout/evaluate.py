"""Runs policies (engines) on tasks through the harness and reports transcripts, rewards and breakdowns."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence

from rollout import harness
from rollout.engines.protocol import Engine
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task
from rollout.trajectory import Trajectory


def format_transcript(traj: Trajectory, max_chars: int = 400) -> str:
  """A readable transcript: one block per message, long contents cut, then the reward and its breakdown."""
  lines = [f"=== {traj.task_id}  stop={traj.stop_reason}  segments={len(traj.segments)}"]
  for m in traj.messages:
    body = m.get("content") or ""
    for call in m.get("tool_calls") or []:
      body += f"\n  -> {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})"
    if len(body) > max_chars:
      body = body[:max_chars] + f" ...[{len(body) - max_chars} more chars]"
    lines.append(f"[{m['role']}] {body}")
  terms = ", ".join(f"{k}={v:+.3f}" for k, v in traj.breakdown.items() if v)
  lines.append(f"reward={traj.reward:+.3f} ({terms or 'all terms 0'}) pass_fraction="
               f"{traj.metrics['pass_fraction']:.2f} tokens={traj.metrics['output_tokens']}")
  return "\n".join(lines)


def evaluate(policies: Mapping[str, Engine], tokenizer, tasks: Sequence[Task], envs: EnvironmentCache,
             cfg: harness.HarnessConfig, n_transcripts: int = 1,
             log: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
  """Rolls out every policy on every task, logs transcripts and a summary line per policy.

  Args:
    policies: name -> engine.
    tokenizer: the tokenizer all engines speak.
    tasks: tasks (one episode each per policy).
    envs: environment cache (snapshots shared by all policies).
    cfg: harness config.
    n_transcripts: transcripts printed per policy.
    log: where lines go.

  Returns:
    name -> summary (mean reward, solve rate, mean breakdown terms, seconds, per-task grading seconds).
  """
  out = {}
  for name, engine in policies.items():
    start = time.perf_counter()
    trajs = harness.run_episodes(engine, tokenizer, tasks, envs, cfg)
    summary = harness.summarize_batch(trajs)
    summary["seconds"] = time.perf_counter() - start
    summary["grade_s_per_task"] = sum(t.metrics["grade_wall_s"] for t in trajs) / len(trajs)
    for t in trajs[:n_transcripts]:
      log(format_transcript(t))
    log(f"[{name}] " + " ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    out[name] = summary
  return out
