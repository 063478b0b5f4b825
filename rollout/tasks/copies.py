"""Copies of a mined project that a task's workspace can read through its interpreter, and the tasks they date.

A workspace sees the Python that runs its tests (the venv, the base installation); an installed package, or one
vendored inside another (setuptools bundles `packaging`, `more_itertools`, `zipp`, ...; pip and torch bundle more),
is one `import` or `cat` away. Mining the history of such a project would hand the agent the project's future:
the fix, and everything after it. Hiding those paths would need per-task mounts in the sandbox; instead a task is
refused when a readable copy is *newer* than the task's starting commit.

How a copy is found and dated:
  1. the project's import names: top-level packages (`X/__init__.py`, `src/X/__init__.py`; not `tests`, `docs`,
     ...) and modules (`X.py`, not setup / conftest / test files) of the repository's HEAD;
  2. a probe run inside a workspace walks the interpreter's `sys.path` (the workspace itself left out) for a
     package directory of one of those names at any depth (vendored copies sit in `_vendor/`, `vendored/`, ...)
     or a module file at the top of a path entry or in a vendoring directory, and hashes every file as git does
     (blob ids);
  3. a copy file is placed in the repository's history when its blob is a version of the matching repository
     path; a copy with no such file is another project of the same name and is ignored;
  4. a task whose parent commit is older than a placed copy file (every commit that made that version is after
     the parent) is refused, naming the copy and the file. Copy files that match no version (edited while
     vendoring, generated at build time) cannot be placed and decide nothing.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Sequence

from rollout.tasks.environment import EnvironmentCache, git
from rollout.tasks.task import Environment

_SCAFFOLDING = {"test", "tests", "testing", "doc", "docs", "example", "examples", "benchmarks", "scripts", "tools"}
_NOT_PROJECT = re.compile(r"^(setup|conftest|noxfile|fabfile|tasks|test_.*|.*_test)\.py$")
_PROBE_OUT = ".readable_copies.json"
# Runs in the workspace: prints nothing, writes {copy path: {"name": ..., "files": {relative path: blob id}}}.
PROBE = r'''
import hashlib, json, os, re, sys
names, out_path = set(sys.argv[1:-1]), sys.argv[-1]
vendoring = re.compile(r"vendor|extern|bundled|third_party")
here = os.path.realpath(os.getcwd())
found = {}

def blob(p):
  with open(p, "rb") as f:
    data = f.read()
  return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

def take(path, name):
  if os.path.isfile(path):
    found[path] = {"name": name, "files": {"": blob(path)}}
    return
  files = {}
  for root, dirs, fs in os.walk(path):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    for f in fs:
      if not f.endswith((".pyc", ".pyo")):
        p = os.path.join(root, f)
        files[os.path.relpath(p, path)] = blob(p)
  found[path] = {"name": name, "files": files}

def walk(d, depth, vendored):
  try:
    entries = list(os.scandir(d))
  except OSError:
    return
  for e in entries:
    if e.is_dir(follow_symlinks=False):
      if e.name in names and os.path.isfile(os.path.join(e.path, "__init__.py")):
        take(e.path, e.name)
      elif depth < 5 and e.name != "__pycache__" and not e.name.endswith((".dist-info", ".egg-info")):
        walk(e.path, depth + 1, bool(vendoring.search(e.name)))
    elif e.name.endswith(".py") and e.name[:-3] in names and (depth == 0 or vendored):
      take(e.path, e.name[:-3])

for entry in dict.fromkeys(os.path.realpath(p) for p in sys.path if p):
  if os.path.isdir(entry) and entry != here and not entry.startswith(here + "/"):
    walk(entry, 0, False)
with open(out_path, "w") as f:
  json.dump(found, f)
'''


def project_names(repo: str, rev: str = "HEAD") -> dict[str, str]:
  """Import name -> repository path of the package directory or module file, at `rev` (a `tests` or `docs`
  package is the project's scaffolding, not the project: many installed distributions ship one of that name)."""
  out = {}
  for path in git(repo, "ls-tree", "-r", "--name-only", rev).splitlines():
    parts = path.split("/")
    if parts[0] in _SCAFFOLDING:
      continue
    if len(parts) == 2 and parts[1] == "__init__.py" and parts[0].isidentifier():
      out[parts[0]] = parts[0]
    elif len(parts) == 3 and parts[0] == "src" and parts[2] == "__init__.py" and parts[1].isidentifier():
      out[parts[1]] = f"src/{parts[1]}"
    elif len(parts) == 1 and path.endswith(".py") and path[:-3].isidentifier() and not _NOT_PROJECT.match(path):
      out[path[:-3]] = path
  return out


@dataclasses.dataclass(frozen=True)
class PlacedFile:
  """A copy file whose content is a version of `repo_path`, made by `commits` (and by no other commit)."""
  copy_path: str
  repo_path: str
  commits: frozenset[str]


class ReadableCopies:
  """The placed files of every readable copy of a repository's project (see the module docstring)."""

  def __init__(self, repo: str, roots: Sequence[str], placed: Sequence[PlacedFile]):
    self.repo, self.roots, self.placed = repo, tuple(roots), tuple(placed)  # roots: the project's package paths

  def newer_than(self, parent: str) -> PlacedFile | None:
    """A copy file made only by commits after `parent` (the task starting there would read its future), or None."""
    if not self.placed:
      return None
    upto = set(git(self.repo, "rev-list", "--full-history", parent, "--", *self.roots).split())
    return next((p for p in self.placed if not p.commits & upto), None)

  def refusal(self, parent: str) -> str:
    """Why a task starting at `parent` must not be used ("" when no readable copy is newer than it)."""
    newer = self.newer_than(parent)
    return "" if newer is None else (f"a readable copy of the project is newer than the parent ({newer.copy_path} is "
                                     f"a version of {newer.repo_path} made after {parent[:12]})")


def _versions(repo: str, prefixes: Sequence[str]) -> dict[tuple[str, str], set[str]]:
  """(repository path, blob id) -> the commits that made that version, over HEAD's whole history."""
  log = git(repo, "log", "--full-history", "--raw", "--no-abbrev", "--no-renames", "--format=%x00%H", "HEAD", "--",
            *prefixes)
  out: dict[tuple[str, str], set[str]] = {}
  for rec in log.split("\x00")[1:]:
    lines = rec.strip("\n").splitlines()
    for line in lines[1:]:
      if line.startswith(":"):
        meta, path = line.split("\t", 1)
        out.setdefault((path, meta.split()[3]), set()).add(lines[0])
  return out


def find(repo: str, envs: EnvironmentCache) -> ReadableCopies:
  """The readable copies of `repo`'s project, as a workspace of `envs` sees its interpreter."""
  names = project_names(repo)
  roots = sorted(names.values())
  if not names:
    return ReadableCopies(repo, roots, ())
  ws = envs.factory.fork(envs.snapshot(Environment()))
  try:
    res = ws.run(f"python -c {shlex.quote(PROBE)} {' '.join(sorted(names))} {_PROBE_OUT}", timeout_s=300)
    if not res.ok:
      raise RuntimeError(f"the readable-copy probe failed in the workspace (exit {res.exit_code}): "
                         f"{res.output[-500:]}")
    found = json.loads(ws.read_file(_PROBE_OUT))
  finally:
    ws.close()
  versions = _versions(repo, roots)
  placed = []
  for copy_path, copy in sorted(found.items()):
    root = names[copy["name"]]
    for rel, blob in sorted(copy["files"].items()):
      repo_path = f"{root}/{rel}" if rel else root
      if (repo_path, blob) in versions:
        placed.append(PlacedFile(f"{copy_path}/{rel}" if rel else copy_path, repo_path,
                                 frozenset(versions[(repo_path, blob)])))
  return ReadableCopies(repo, roots, placed)
