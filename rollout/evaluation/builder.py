"""Set builder: mines a benchmark from local git repositories with CursorBench-style filters and writes a frozen,
versioned set file (JSON: name, version, filters, sources, tasks, and a sha256 of the tasks that `read_set` checks).

Filters (on the gold patch, counted by `stats.diff_size`): at least `min_files` changed files (multi-file changes),
at least `min_lines` changed lines, and prompts of at most `max_prompt_chars` characters (terse requests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from collections.abc import Sequence

from rollout.evaluation.stats import diff_size
from rollout.tasks import miner
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task

FORMAT = "composer_jax.eval_set/1"


@dataclasses.dataclass(frozen=True)
class SetFilters:
  """Which mined tasks enter the set."""
  min_files: int = 1
  min_lines: int = 1
  max_prompt_chars: int = 1000


def filter_reason(task: Task, f: SetFilters) -> str:
  """Why `task` fails the filters, or ""."""
  lines, files = diff_size(task.gold_patch)
  if files < f.min_files:
    return f"gold patch changes {files} files < min_files={f.min_files}"
  if lines < f.min_lines:
    return f"gold patch changes {lines} lines < min_lines={f.min_lines}"
  if len(task.prompt) > f.max_prompt_chars:
    return f"prompt has {len(task.prompt)} chars > max_prompt_chars={f.max_prompt_chars}"
  return ""


def _tasks_digest(task_dicts: list[dict]) -> str:
  return hashlib.sha256(json.dumps(task_dicts, sort_keys=True).encode()).hexdigest()


def build_set(repos: Sequence[str], envs: EnvironmentCache, filters: SetFilters = SetFilters(),
              miner_cfg: miner.MinerConfig | None = None, *, name: str, version: str,
              log=print) -> tuple[dict, list[tuple[str, str]]]:
  """Mines `repos` (validated by the miner in sandboxes), keeps tasks passing `filters`.

  Returns:
    (the set as a JSON-able dict, [(commit or task id, why excluded)]).
  """
  miner_cfg = miner_cfg or miner.MinerConfig()
  tasks, excluded, sources = [], [], []
  for repo in repos:
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
      raise ValueError(f"{repo!r} is not a git repository: {head.stderr.strip()[:200]}")
    sources.append({"repo": repo, "head": head.stdout.strip()})
    mined, rejected = miner.mine(repo, envs, miner_cfg)
    excluded += [(r.commit, r.reason) for r in rejected]
    for t in mined:
      why = filter_reason(t, filters)
      (excluded.append((t.id, why)) if why else tasks.append(t))
    log(f"[builder] {repo}: {len(mined)} mined, {len(rejected)} rejected by the miner")
  dicts = [t.to_dict() for t in sorted(tasks, key=lambda t: t.id)]
  out = {"format": FORMAT, "name": name, "version": version, "filters": dataclasses.asdict(filters),
         "miner": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(miner_cfg).items()},
         "sources": sources, "tasks": dicts, "sha256": _tasks_digest(dicts)}
  return out, excluded


def write_set(path: str, task_set: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(task_set, f, indent=1, sort_keys=True)


def read_set(path: str) -> tuple[dict, list[Task]]:
  """(set header without tasks, tasks); raises if the file is not a set or its tasks were edited."""
  with open(path, encoding="utf-8") as f:
    d = json.load(f)
  if d.get("format") != FORMAT:
    raise ValueError(f"{path}: not an evaluation set file (format {d.get('format')!r}, want {FORMAT!r})")
  if _tasks_digest(d["tasks"]) != d["sha256"]:
    raise ValueError(f"{path}: tasks do not match the recorded sha256; the frozen set was modified")
  return {k: v for k, v in d.items() if k != "tasks"}, [Task.from_dict(t) for t in d["tasks"]]
