"""Mines tasks from a local git repository's history: commits that change code and tests together.

For each non-merge commit C with parent P (newest first, `max_commits` of them):
  1. split its changes into test files (`test_pattern`) and code files (`code_suffixes`); both must change;
  2. prompt = the commit subject and body with what the agent cannot follow dropped (`prompts.py`); prompts that
     are not self-contained are rejected;
  3. gold patch = the code diff; hidden tests = the test diff. A commit whose gold diff undoes (or repeats) the
     gold diff of an older commit in the set is rejected (`diffkey.py`: a revert is found by its diff, whatever
     its message says), and so is one whose message names a reverted commit in the set; so is a commit older than
     a copy of the project the workspace's interpreter can read (`copies.py`: an installed or vendored copy);
  4. validate in workspaces forked from the repository at P (holding only P's history): run the changed test files
     with the test patch applied, `runs_per_side` times without and with the gold patch, reading each run's
     machine-readable report. fail_to_pass = tests that fail, error or cannot even be collected in every run before
     and pass in every run after; pass_to_pass = tests that pass in every run of both; a test whose result differs
     between runs of the same side is flaky: excluded from both and counted (`metadata["flaky"]`). A commit with no
     fail_to_pass test is rejected; so is one whose runs time out (`timeout_s`).
  5. the task's grading timeout is `timeout_factor` x the slowest gold run (at least `min_timeout_s`), stored with
     the task, so a policy is not failed by a limit fixed before anyone measured the suite.
Every rejected commit is reported with its reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Mapping

from rollout.tasks import copies, diffkey, prompts
from rollout.tasks.environment import EnvironmentCache, TestRun, apply_patch, git, run_tests
from rollout.tasks.progress import Progress
from rollout.tasks.task import Environment, HiddenTests, Task


class MiningError(ValueError):
  """A repository cannot be mined (not a git repository, a subdirectory of one, a failing git command)."""


@dataclasses.dataclass(frozen=True)
class MinerConfig:
  """What counts as a test / code change and how tests run.

  Attributes:
    test_pattern: regex on repository paths marking test files.
    code_suffixes: suffixes of code files (other files, e.g. docs, are ignored).
    test_command: shell command; `{files}` is replaced by the changed test files. Must run pytest (the grader
      loads its report plugin into it; see `grade_report`).
    max_commits: newest commits examined.
    timeout_s: limit for one test run while mining.
    runs_per_side: runs before and after the gold patch (>= 2 to tell flaky tests apart).
    timeout_factor: a task's grading timeout is this many times its slowest gold run ...
    min_timeout_s: ... but at least this.
    setup: environment setup commands (e.g. offline installs), run once per base commit.
    prompt_max_chars: prompts are cut to this length.
    min_prompt_words: prompts with fewer words (after dropping references) are not self-contained: rejected.
    progress: show a progress bar (stderr) with counts and rejection reasons.
  """
  test_pattern: str = r"(^|/)(tests?/.*\.py|test_[^/]*\.py|[^/]*_test\.py)$"
  code_suffixes: tuple[str, ...] = (".py",)
  test_command: str = "python -m pytest -q -p no:cacheprovider {files}"
  max_commits: int = 200
  timeout_s: float = 120.0
  runs_per_side: int = 2
  timeout_factor: float = 5.0
  min_timeout_s: float = 10.0
  setup: tuple[str, ...] = ()
  prompt_max_chars: int = 2000
  min_prompt_words: int = 3
  progress: bool = True

  def __post_init__(self):
    object.__setattr__(self, "code_suffixes", tuple(self.code_suffixes))
    object.__setattr__(self, "setup", tuple(self.setup))
    if self.runs_per_side < 2:
      raise ValueError(f"runs_per_side must be >= 2 (flaky tests are found by comparing runs), got "
                       f"{self.runs_per_side}")
    if "{files}" not in self.test_command:
      raise ValueError(f"MinerConfig.test_command needs a {{files}} placeholder, got {self.test_command!r}")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A commit examined by the miner."""
  commit: str
  parent: str
  subject: str
  body: str = ""


@dataclasses.dataclass(frozen=True)
class Rejection:
  """A commit that did not become a task, and why."""
  commit: str
  reason: str


def repo_root(repo: str) -> str:
  """The absolute path of `repo`, which must be the top of a git working tree (or a bare repository)."""
  path = os.path.abspath(repo)
  if not os.path.isdir(path):
    raise MiningError(f"{repo!r} is not a directory")
  if git(path, "rev-parse", "--is-bare-repository", error=MiningError).strip() == "true":
    return path
  top = git(path, "rev-parse", "--show-toplevel", error=MiningError).strip()
  if os.path.realpath(top) != os.path.realpath(path):
    raise MiningError(f"{repo!r} is a subdirectory of the git repository {top!r}; pass the repository's root "
                      "(tasks are built from whole commits)")
  return path


def candidates(repo: str, cfg: MinerConfig) -> list[Candidate]:
  """Non-merge commits, newest first."""
  log = git(repo, "log", "--no-merges", f"-n{cfg.max_commits}", "--format=%H%x00%P%x00%s%x00%b%x1e",
            error=MiningError)
  out = []
  for rec in log.split("\x1e"):
    if not rec.strip():
      continue
    sha, parents, subject, body = rec.strip("\n").split("\x00")
    out.append(Candidate(sha, parents.split()[0] if parents else "", subject.strip(), body.strip()))
  return out


def _run_side(envs: EnvironmentCache, env: Environment, patches: list[str], command: str,
              cfg: MinerConfig) -> tuple[list[TestRun] | None, str]:
  """`runs_per_side` runs in fresh forks with `patches` applied, or (None, reason)."""
  runs = []
  for _ in range(cfg.runs_per_side):
    ws = envs.factory.fork(envs.snapshot(env))
    try:
      for patch in patches:
        res = apply_patch(ws, patch)
        if not res.ok:
          return None, f"patch does not apply: {res.output.strip()[-200:]}"
      run = run_tests(ws, command, "pytest", cfg.timeout_s)
    finally:
      ws.close()
    if run.timed_out:
      return None, f"tests timed out after {cfg.timeout_s:g} s"
    if not run.reported:
      return None, run.no_report_reason()
    runs.append(run)
  return runs, ""


def label(before: list[TestRun], after: list[TestRun]) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
  """(fail_to_pass, pass_to_pass, flaky) from repeated runs of each side (see the module docstring)."""
  ids = sorted({t for r in before + after for t in r.results})
  status = {side: {t: {r.results.get(t, "MISSING") for r in runs} for t in ids}
            for side, runs in (("before", before), ("after", after))}
  flaky = [t for t in ids if len(status["before"][t]) > 1 or len(status["after"][t]) > 1]
  passing_after = [t for t in ids if t not in flaky and status["after"][t] == {"PASSED"}]
  f2p = tuple(t for t in passing_after if status["before"][t] != {"PASSED"})
  p2p = tuple(t for t in passing_after if status["before"][t] == {"PASSED"})
  return f2p, p2p, flaky


def _split_changes(repo: str, c: Candidate, cfg: MinerConfig) -> tuple[list[str], list[str], list[str]] | str:
  """(code files, test files touched, test files to run) of a commit, or why it is no task."""
  status = [line.split("\t") for line in git(repo, "diff", "--name-status", c.parent, c.commit,
                                             error=MiningError).splitlines()]
  test_re = re.compile(cfg.test_pattern)
  tests = [(s[0], s[-1]) for s in status if test_re.search(s[-1])]
  code = [s[-1] for s in status if not test_re.search(s[-1]) and s[-1].endswith(cfg.code_suffixes)]
  if not code:
    return "no code file changed"
  if not tests:
    return "no test file changed"
  to_run = [p for s, p in tests if not s.startswith("D")]
  if not to_run:
    return "the commit only deletes tests"
  return code, [p for _, p in tests], to_run


def gold_diff(repo: str, c: Candidate, code: list[str]) -> str:
  """The commit's gold patch: its diff of the code files `code`."""
  return git(repo, "diff", "--no-renames", c.parent, c.commit, "--", *code, error=MiningError)


def mine_commit(repo: str, c: Candidate, envs: EnvironmentCache, cfg: MinerConfig = MinerConfig(),
                in_set: frozenset[str] = frozenset(), older: Mapping[str, str] | None = None,
                readable: copies.ReadableCopies | None = None) -> Task | Rejection:
  """One candidate commit -> a validated Task, or a Rejection with the reason.

  Args:
    in_set: shas of the commits mined together with it (a commit whose message reverts one of them is no task).
    older: gold-diff fingerprint (`diffkey.fingerprint`) -> sha of the commits in the set older than `c`: a commit
      whose gold diff is the inverse of one of them (a revert) or equal to one (a re-land, a cherry-pick) is no task.
    readable: copies of the project the workspace's interpreter can read (`copies.find`): a commit whose parent is
      older than one of them is no task (its future would be readable).
  """
  if not c.parent:
    return Rejection(c.commit, "root commit (no parent to start from)")
  changes = _split_changes(repo, c, cfg)
  if isinstance(changes, str):
    return Rejection(c.commit, changes)
  code, test_paths, to_run = changes
  gold = gold_diff(repo, c, code)
  change = diffkey.change_of(gold)
  for what, fp in (("repeats", diffkey.fingerprint(change)),
                   ("reverts", diffkey.fingerprint(diffkey.inverse(change)))):
    if fp and fp in (older or {}):
      return Rejection(c.commit, f"{what} an older commit in the set (its gold diff is "
                       f"{'the inverse of' if what == 'reverts' else 'the same as'} {older[fp][:12]}'s)")
  reverted = prompts.reverted_commit(c.subject, c.body)
  if reverted and any(s.startswith(reverted) for s in in_set):
    return Rejection(c.commit, f"reverts a commit in the set ({reverted[:12]})")
  prompt = prompts.prompt_from_message(c.subject, c.body, cfg.prompt_max_chars)
  why = prompts.not_self_contained(prompt, cfg.min_prompt_words)
  if why:
    return Rejection(c.commit, why)
  why = readable.refusal(c.parent) if readable else ""
  if why:
    return Rejection(c.commit, why)
  test_patch = git(repo, "diff", "--no-renames", c.parent, c.commit, "--", *test_paths, error=MiningError)
  env = Environment(repo=repo, commit=c.parent, setup=cfg.setup)
  command = cfg.test_command.format(files=" ".join(shlex.quote(p) for p in to_run))
  before, why = _run_side(envs, env, [test_patch], command, cfg)
  if before is None:
    return Rejection(c.commit, f"before the fix: {why}")
  after, why = _run_side(envs, env, [test_patch, gold], command, cfg)
  if after is None:
    return Rejection(c.commit, f"with the gold patch: {why}")
  f2p, p2p, flaky = label(before, after)
  if not f2p:
    return Rejection(c.commit, "no test goes from failing to passing" +
                     (f" ({len(flaky)} flaky tests excluded)" if flaky else ""))
  gold_s = max(r.wall_s for r in after)
  numstat = git(repo, "diff", "--numstat", c.parent, c.commit, "--", *code, error=MiningError)
  changed_lines = sum(int(a) + int(d) for a, d, _ in (ln.split("\t") for ln in numstat.splitlines()) if a != "-")
  name = re.sub(r"[^\w.-]", "_", os.path.basename(repo.rstrip("/")).removesuffix(".git"))
  return Task(id=f"miner/{name}/{c.commit[:12]}", language="python", prompt=prompt, environment=env,
              tests=HiddenTests(command=command, fail_to_pass=f2p, pass_to_pass=p2p, patch=test_patch,
                                timeout_s=round(max(cfg.min_timeout_s, cfg.timeout_factor * gold_s), 1)),
              gold_patch=gold,
              metadata={"source": "miner", "commit": c.commit, "parent": c.parent, "subject": c.subject,
                        "changed_files": code, "changed_lines": changed_lines, "flaky": flaky,
                        "gold_test_s": round(gold_s, 3),
                        "failed_after": sorted(t for t, s in after[-1].results.items() if s != "PASSED")})


def _gold_fingerprint(repo: str, c: Candidate, cfg: MinerConfig) -> str:
  """`diffkey.fingerprint` of the commit's gold diff ("" for a commit that cannot be a task)."""
  changes = _split_changes(repo, c, cfg) if c.parent else "root"
  return "" if isinstance(changes, str) else diffkey.fingerprint(diffkey.change_of(gold_diff(repo, c, changes[0])))


def mine(repo: str, envs: EnvironmentCache, cfg: MinerConfig = MinerConfig(),
         log=print) -> tuple[list[Task], list[Rejection]]:
  """Mines every candidate commit of `repo` (newest first).

  Args:
    repo: path of a local git repository's root (stored absolute in the tasks).
    envs: environment cache (its factory makes the validation sandboxes).
    cfg: miner settings.
    log: the summary line (counts per rejection reason); a progress bar shows them as they happen.

  Returns:
    (valid tasks, rejections with reasons).
  """
  repo = repo_root(repo)
  cands = candidates(repo, cfg)
  in_set = frozenset(c.commit for c in cands)
  fps = [_gold_fingerprint(repo, c, cfg) for c in cands]
  readable = copies.find(repo, envs)
  tasks, rejected = [], []
  with Progress(f"mine {os.path.basename(repo)}", len(cands), cfg.progress) as bar:
    for i, c in enumerate(cands):  # newest first: the commits after c in `cands` are older than it
      older = {fp: cand.commit for fp, cand in zip(fps[i + 1:], cands[i + 1:], strict=True) if fp}
      out = mine_commit(repo, c, envs, cfg, in_set, older, readable)
      if isinstance(out, Task):
        tasks.append(out)
        bar.kept()
      else:
        rejected.append(out)
        bar.rejected(out.reason)
  log(f"[mine] {repo}: {len(cands)} commits, {bar.summary()}")
  return tasks, rejected
