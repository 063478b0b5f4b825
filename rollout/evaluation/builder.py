"""Set builder: mines a benchmark from local git repositories with CursorBench-style filters and writes a frozen,
versioned set file (`rollout.tasks.setfile`: name, version, filters, sources, tasks and their sha256).

Filters (on the gold patch, counted by `stats.diff_size`): at least `min_files` changed files (multi-file changes),
at least `min_lines` changed lines, and prompts of at most `max_prompt_chars` characters (terse requests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rollout.evaluation.stats import diff_size
from rollout.tasks import miner, setfile
from rollout.tasks.environment import EnvironmentCache, git
from rollout.tasks.task import Task


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
    root = miner.repo_root(repo)  # absolute; a subdirectory or a non-repository is a clear error
    sources.append({"repo": root, "head": git(root, "rev-parse", "HEAD", error=miner.MiningError).strip()})
    mined, rejected = miner.mine(root, envs, miner_cfg, log=log)
    excluded += [(r.commit, r.reason) for r in rejected]
    for t in mined:
      why = filter_reason(t, filters)
      (excluded.append((t.id, why)) if why else tasks.append(t))
    log(f"[builder] {repo}: {len(mined)} mined, {len(rejected)} rejected by the miner")
  dicts = [t.to_dict() for t in sorted(tasks, key=lambda t: t.id)]
  out = {"format": setfile.FORMAT, "name": name, "version": version, "filters": dataclasses.asdict(filters),
         "miner": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(miner_cfg).items()},
         "sources": sources, "tasks": dicts, "sha256": setfile.tasks_digest(dicts)}
  return out, excluded
