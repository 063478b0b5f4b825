"""Loads SWE-bench-style JSONL instances as tasks, offline, against local copies of the repositories.

An instance has `instance_id`, `repo` ("owner/name"), `base_commit`, `patch` (gold), `test_patch`, `FAIL_TO_PASS`
and `PASS_TO_PASS` (lists, or JSON strings of lists, as in the published files) and `problem_statement` (the prompt).
The repository is looked up under `repos_dir` as `owner__name`, `name` or `owner/name` (a clone with the commit).
Hidden tests: the test patch is applied at grading, then the test files it touches are run with `test_command`
(pytest by default, whose "<file>::<test>" node ids are SWE-bench's ids for pytest repositories; repositories
with other runners, e.g. Django's, need their own command via `test_commands`, one that writes the grading report
itself: see `grade_report.py`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping

from rollout import jsonl
from rollout.tasks.task import Environment, HiddenTests, Task

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
DEFAULT_TEST_COMMAND = "python -m pytest -q -p no:cacheprovider {files}"


def _ids(value, field: str, instance: str) -> tuple[str, ...]:
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as e:
      raise ValueError(f"{instance}: {field} is a string but not a JSON list ({e.msg})") from None
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise ValueError(f"{instance}: {field} must be a list of test ids, got {type(value).__name__}")
  return tuple(value)


def find_repo(repos_dir: str, repo: str) -> str:
  """Local clone of `owner/name` under repos_dir (absolute, so a set works from any directory), or a
  FileNotFoundError listing where it looked."""
  owner, _, name = repo.partition("/")
  tried = [os.path.join(repos_dir, f"{owner}__{name}"), os.path.join(repos_dir, name), os.path.join(repos_dir, repo)]
  for path in tried:
    if os.path.isdir(os.path.join(path, ".git")) or os.path.isfile(os.path.join(path, "HEAD")):
      return os.path.abspath(path)
  raise FileNotFoundError(f"no local clone of {repo!r}; looked in {tried}")


def instance_to_task(inst: Mapping, repos_dir: str, test_commands: Mapping[str, str] | None = None,
                     setup: Mapping[str, tuple[str, ...]] | None = None, timeout_s: float = 600.0) -> Task:
  """One SWE-bench-style instance -> Task (see the module docstring)."""
  name = inst.get("instance_id", "<no instance_id>")
  missing = [k for k in REQUIRED if k not in inst]
  if missing:
    raise ValueError(f"instance {name}: missing fields {missing}")
  f2p, p2p = _ids(inst["FAIL_TO_PASS"], "FAIL_TO_PASS", name), _ids(inst["PASS_TO_PASS"], "PASS_TO_PASS", name)
  test_files = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", inst["test_patch"], re.MULTILINE)))
  if not test_files:
    raise ValueError(f"instance {name}: test_patch touches no files")
  command = (test_commands or {}).get(inst["repo"], DEFAULT_TEST_COMMAND)
  command = command.format(files=" ".join(shlex.quote(f) for f in test_files))
  changed = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", inst["patch"], re.MULTILINE)))
  lines = sum(1 for ln in inst["patch"].splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---")))
  return Task(
    id=f"swe/{name}", language=inst.get("language", "python"),
    prompt=inst.get("problem_statement", "").strip() or f"Fix the failing tests {list(f2p)}",
    environment=Environment(repo=find_repo(repos_dir, inst["repo"]), commit=inst["base_commit"],
                            setup=tuple((setup or {}).get(inst["repo"], ()))),
    tests=HiddenTests(command=command, fail_to_pass=f2p, pass_to_pass=p2p, patch=inst["test_patch"],
                      timeout_s=timeout_s),
    gold_patch=inst["patch"],
    metadata={"source": "swe", "repo": inst["repo"], "changed_files": changed, "changed_lines": lines})


def load_jsonl(path: str, repos_dir: str, **kwargs) -> list[Task]:
  """Every instance of a JSONL file as a Task; kwargs go to `instance_to_task`. Errors name the line."""
  tasks = []
  for i, inst in jsonl.records(path):
    try:
      tasks.append(instance_to_task(inst, repos_dir, **kwargs))
    except (ValueError, FileNotFoundError) as e:
      raise type(e)(f"{path}:{i}: {e}") from None
  return tasks
