"""The one task format every source produces (procedural family, git-history miner, SWE-bench-style loader).

A `Task` is plain data (JSON round trip with `to_dict`/`from_dict`):

  id            unique string, e.g. "proc/L1/3f2a9c" or "miner/myrepo/1a2b3c4"
  language      "python", ...
  prompt        the terse user request the agent sees
  environment   how to build the starting files: a directory, or a git repository at a commit, plus inline files,
                then setup commands run once; the result is frozen as a workspace snapshot (see `environment.py`)
  tests         hidden tests, never shown to the agent: written/applied into the workspace only at grading time.
                `command` runs them and leaves a machine-readable report (`grade_report.py`: any pytest command,
                or a script of ours); every id in `fail_to_pass` and `pass_to_pass` must be reported PASSED for the
                task reward to be 1
  gold_patch    optional unified diff (`git apply -p1` format) that solves the task
  metadata      free-form; sources record at least `changed_files` and `changed_lines` of the gold patch
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rollout.tasks.grade_report import REPORT_KINDS


@dataclasses.dataclass(frozen=True)
class Environment:
  """How to build a task's starting workspace.

  Attributes:
    base_dir: copy this directory (mutually exclusive with repo).
    repo: a local git repository path; checked out at `commit` (the .git directory is kept).
    commit: commit-ish for `repo`.
    files: inline files written on top (path -> text).
    setup: shell commands run once in the built workspace before it is frozen (e.g. installs).
  """
  base_dir: str | None = None
  repo: str | None = None
  commit: str | None = None
  files: Mapping[str, str] = dataclasses.field(default_factory=dict)
  setup: tuple[str, ...] = ()

  def __post_init__(self):
    if self.base_dir and self.repo:
      raise ValueError("Environment takes base_dir or repo, not both")
    if bool(self.repo) != bool(self.commit):
      raise ValueError(f"Environment.repo and commit go together, got repo={self.repo!r} commit={self.commit!r}")

  def key(self) -> str:
    """A cache key: equal keys build equal snapshots."""
    return repr((self.base_dir, self.repo, self.commit, sorted(self.files.items()), self.setup))


@dataclasses.dataclass(frozen=True)
class HiddenTests:
  """The grader.

  Attributes:
    command: shell command, run in the workspace root.
    fail_to_pass: ids that fail (or cannot run) before the fix and must pass after.
    pass_to_pass: ids that pass before and must keep passing.
    files: test files written (overwriting) right before grading.
    patch: a unified diff applied right before grading (files it touches are first restored from the environment).
    timeout_s: wall-clock limit for the command (the miner calibrates it from the measured gold run).
    report: how results are reported (`grade_report.REPORT_KINDS`): 'pytest' (a plugin the grader loads into any
      pytest command) or 'script' (the command writes the report itself); console output is never parsed.
  """
  command: str
  fail_to_pass: tuple[str, ...]
  pass_to_pass: tuple[str, ...] = ()
  files: Mapping[str, str] = dataclasses.field(default_factory=dict)
  patch: str = ""
  timeout_s: float = 60.0
  report: str = "pytest"

  def __post_init__(self):
    if not self.fail_to_pass:
      raise ValueError("HiddenTests.fail_to_pass is empty: a task needs at least one test its fix must make pass")
    if self.report not in REPORT_KINDS:
      raise ValueError(f"unknown HiddenTests.report {self.report!r}; valid: {REPORT_KINDS}")


@dataclasses.dataclass(frozen=True)
class Task:
  """One task (see the module docstring)."""
  id: str
  language: str
  prompt: str
  environment: Environment
  tests: HiddenTests
  gold_patch: str = ""
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["environment"]["files"] = dict(self.environment.files)
    d["environment"]["setup"] = list(self.environment.setup)
    d["tests"]["files"] = dict(self.tests.files)
    for k in ("fail_to_pass", "pass_to_pass"):
      d["tests"][k] = list(d["tests"][k])
    d["metadata"] = dict(self.metadata)
    return d

  @staticmethod
  def from_dict(d: Mapping[str, Any]) -> Task:
    env = dict(d["environment"])
    env["setup"] = tuple(env.get("setup", ()))
    tests = dict(d["tests"])
    tests.pop("nonce", None)  # set files written before grading read a report file (every kind now uses a nonce)
    for k in ("fail_to_pass", "pass_to_pass"):
      tests[k] = tuple(tests.get(k, ()))
    return Task(id=d["id"], language=d["language"], prompt=d["prompt"], environment=Environment(**env),
                tests=HiddenTests(**tests), gold_patch=d.get("gold_patch", ""), metadata=dict(d.get("metadata", {})))
