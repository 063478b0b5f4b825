"""The one registry of task sources, shared by SFT, RL and evaluation: a `SetSpec` names a source (`kind`) and its
options, and `load_tasks(spec, envs)` returns its tasks in the one `Task` format.

Sources (see rollout/tasks/README.md for how to add one):
  procedural  generated repair tasks: `n` tasks spread evenly over `levels` (a mix, e.g. (1, 2, 3)), of one `split`.
              Train and held-out are disjoint by construction — every function *core* (expression, bug) hashes to
              one split, with the same share for every level — so no held-out core appears in a training mix.
  mined       tasks mined now from the git history of local repositories `repos` (settings: `miner`).
  swe         a SWE-bench-style JSONL file `jsonl` against local clones under `repos_dir`.
  file        a frozen set file `path` (written by `rollout/evaluation/builder.py`; its sha256 is checked).

Every finite source (all but procedural) can be split too: `split="all"` (the default) keeps every task, "train" /
"heldout" keep the tasks whose split key hashes to that side (`heldout_percent` of them held out), so RL can train on
a mined set and be evaluated on the rest of it. The split key is the gold patch's `diffkey.family_key` (the id for a
task without one): a change and its revert, or two copies of one change, can never straddle the split. `n > 0`
keeps the first n (source order), 0 keeps all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable

from rollout.tasks import diffkey, miner, procedural, setfile, swe
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.miner import MinerConfig
from rollout.tasks.task import Task

Log = Callable[[str], None]
Loader = Callable[["SetSpec", EnvironmentCache, Log], list[Task]]
SOURCES: dict[str, Loader] = {}
SPLITS = ("all", "train", "heldout")


def register(kind: str) -> Callable[[Loader], Loader]:
  """Decorator: `@register("mykind") def load(spec, envs, log) -> list[Task]` makes `SetSpec(kind="mykind")` valid."""
  def deco(fn: Loader) -> Loader:
    if kind in SOURCES:
      raise ValueError(f"task source {kind!r} is already registered")
    SOURCES[kind] = fn
    return fn
  return deco


@dataclasses.dataclass(frozen=True)
class SetSpec:
  """A task set: which source and its options (fields a source does not use are ignored by it).

  Attributes:
    kind: a registered source, one of `SOURCES` (procedural, mined, swe, file, ...).
    n: at most this many tasks (0 = all; procedural needs n > 0).
    seed: procedural generator seed.
    split: 'train' | 'heldout' (procedural: required), or 'all' (finite sources; see the module docstring).
    levels: procedural difficulty levels (`procedural.DIFFICULTY`); n is spread evenly over them.
    repos: mined: local git repositories.
    jsonl: swe: the JSONL file.
    repos_dir: swe: where the clones are.
    path: file: the frozen set file.
    heldout_percent: share of a finite source's tasks in its 'heldout' split.
    miner: mined: how commits become tasks.
  """
  kind: str
  n: int = 0
  seed: int = 0
  split: str = "all"
  levels: tuple[int, ...] = (1,)
  repos: tuple[str, ...] = ()
  jsonl: str = ""
  repos_dir: str = ""
  path: str = ""
  heldout_percent: int = 20
  miner: MinerConfig = MinerConfig()

  def __post_init__(self):
    for name in ("levels", "repos"):  # lists from JSON / ConfigDicts
      object.__setattr__(self, name, tuple(getattr(self, name)))
    if self.kind not in SOURCES:
      raise ValueError(f"unknown task source {self.kind!r}; valid: {sorted(SOURCES)}")
    if self.split not in SPLITS:
      raise ValueError(f"unknown split {self.split!r}; valid: {SPLITS}")
    if self.n < 0 or not 0 < self.heldout_percent < 100:
      raise ValueError(f"need n >= 0 and 0 < heldout_percent < 100; got n={self.n}, "
                       f"heldout_percent={self.heldout_percent}")

  @property
  def name(self) -> str:
    """A readable name of the set (output directories, plot titles): what it is, not only its kind."""
    def stem(path):
      return os.path.splitext(os.path.basename(path.rstrip("/")))[0]
    names = {"procedural": lambda: f"procedural-L{'+'.join(map(str, self.levels))}-{self.split}",
             "mined": lambda: "mined-" + "+".join(stem(r) for r in self.repos),
             "swe": lambda: "swe-" + stem(self.jsonl), "file": lambda: stem(self.path)}
    base = names[self.kind]() if self.kind in names else self.kind
    return base + (f"-{self.split}" if self.kind != "procedural" and self.split != "all" else "") + \
      (f"-n{self.n}" if self.n and self.kind != "procedural" else "")


def split_key(task: Task) -> str:
  """What decides a finite source's split: the gold patch's family key (a change, its revert and their copies
  share it), or the task id when the gold patch changes no line."""
  return diffkey.family_key(task.gold_patch) or task.id


def split_of(task: Task, heldout_percent: int) -> str:
  """'train' or 'heldout' for a task of a finite source, by a hash of `split_key` (stable across runs and
  machines)."""
  h = int(hashlib.sha256(split_key(task).encode()).hexdigest()[:8], 16) % 100
  return "heldout" if h < heldout_percent else "train"


def load_tasks(spec: SetSpec, envs: EnvironmentCache, log: Log = print) -> list[Task]:
  """The tasks of `spec` (see the module docstring); ids are unique within the result.

  Args:
    spec: which source and its options.
    envs: environment cache (the miner validates commits in sandboxes forked from it).
    log: progress lines.
  """
  tasks = SOURCES[spec.kind](spec, envs, log)
  if spec.kind != "procedural" and spec.split != "all":
    tasks = [t for t in tasks if split_of(t, spec.heldout_percent) == spec.split]
  if spec.n:
    tasks = tasks[:spec.n]
  seen: dict[str, int] = {}
  for t in tasks:
    seen[t.id] = seen.get(t.id, 0) + 1
  dup = sorted(i for i, k in seen.items() if k > 1)
  if dup:
    raise ValueError(f"task source {spec.kind!r} produced duplicate task ids {dup[:5]}")
  return tasks


@register("procedural")
def _procedural(spec: SetSpec, envs: EnvironmentCache, log: Log) -> list[Task]:
  del envs, log
  if spec.split not in ("train", "heldout"):
    raise ValueError(f"procedural tasks need split='train' or 'heldout' (got {spec.split!r})")
  if spec.n < 1:
    raise ValueError("procedural tasks need n > 0 (the generator has no end)")
  bad = [lv for lv in spec.levels if lv not in procedural.DIFFICULTY]
  if bad or not spec.levels:
    raise ValueError(f"unknown procedural levels {bad or list(spec.levels)}; valid: {sorted(procedural.DIFFICULTY)}")
  per_level = [procedural.generate(spec.n // len(spec.levels) + (i < spec.n % len(spec.levels)), seed=spec.seed,
                                   split=spec.split, level=lv) for i, lv in enumerate(spec.levels)]
  # Interleaved, so that any prefix (spec.n of a bigger mix) is itself a mix of levels.
  return [ts[i] for i in range(max(map(len, per_level))) for ts in per_level if i < len(ts)]


@register("mined")
def _mined(spec: SetSpec, envs: EnvironmentCache, log: Log) -> list[Task]:
  if not spec.repos:
    raise ValueError("the 'mined' task source needs repos (local git repositories, e.g. repos=/src/a:/src/b)")
  tasks = []
  for repo in spec.repos:
    mined, _ = miner.mine(os.path.abspath(repo), envs, spec.miner, log=log)
    tasks += mined
  return tasks


@register("swe")
def _swe(spec: SetSpec, envs: EnvironmentCache, log: Log) -> list[Task]:
  del envs, log
  if not spec.jsonl or not spec.repos_dir:
    raise ValueError(f"the 'swe' task source needs jsonl and repos_dir (got jsonl={spec.jsonl!r}, "
                     f"repos_dir={spec.repos_dir!r})")
  return swe.load_jsonl(spec.jsonl, spec.repos_dir)


@register("file")
def _file(spec: SetSpec, envs: EnvironmentCache, log: Log) -> list[Task]:
  del envs
  header, tasks = setfile.read_set(spec.path)
  log(f"[file] {header['name']} v{header['version']}: {len(tasks)} tasks")
  return tasks
