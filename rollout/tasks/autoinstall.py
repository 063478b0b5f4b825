"""Environment-setup ("auto-install") tasks: explore a repository with no instructions, write install commands and a
verification command; validated in a fresh fork and saved as an environment snapshot for other tasks.

The agent's answer is two files in its workspace: `.setup/install.sh` (install commands) and `.setup/verify.sh`
(a check that the install worked). `validate_setup` replays them in a *fresh* fork of the original environment (so
nothing the agent did by hand counts):

  1. verify.sh must FAIL before installing (else it checks nothing, or there was nothing to install);
  2. install.sh must succeed (offline: packages come from a local wheel directory);
  3. verify.sh must then pass, and so must the task's hidden check (e.g. importing the package);
  4. the fork is frozen into a snapshot that other tasks can start from.

Installs go to `.deps` in the workspace (`pip install --target .deps`, then `PYTHONPATH=.deps:.`), because the
interpreter's own environment is read-only inside a sandbox. `heuristic_plan` is the baseline policy (pyproject /
setup.cfg / setup.py / requirements.txt / package.json detection); `heuristic_setup_policy` drives the same
baseline through the harness as a scripted engine policy.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

from rollout import chat_format as cf
from rollout.tasks.environment import EnvironmentCache, TestReport, grade
from rollout.tasks.grade_report import SCRIPT_REPORTER
from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import Workspace

INSTALL = ".setup/install.sh"
VERIFY = ".setup/verify.sh"
DEPS = ".deps"
MANIFESTS = ("pyproject.toml", "setup.cfg", "setup.py", "requirements.txt", "package.json")
PROMPT = ("Set up this project offline (wheels are in {wheels}). Write install commands to " + INSTALL +
          " and a command that checks the install to " + VERIFY + ". Install Python packages into " + DEPS +
          " (pip --target); code runs with PYTHONPATH=" + DEPS + ":.")


@dataclasses.dataclass(frozen=True)
class InstallPlan:
  """Install commands and a verification command (shell)."""
  install: tuple[str, ...]
  verify: str


@dataclasses.dataclass(frozen=True)
class SetupResult:
  """Outcome of `validate_setup`.

  Attributes:
    ok: the plan passed every check.
    reason: why not ("" when ok).
    report: the hidden check's report.
    environment: the task's environment with the plan's install commands appended to its setup (None unless ok);
      it is registered in the EnvironmentCache with the installed snapshot, so tasks using it start installed.
    snapshot: the installed snapshot (None unless ok).
  """
  ok: bool
  reason: str
  report: TestReport
  environment: Environment | None = None
  snapshot: object | None = None


def _import_check(modules: tuple[str, ...]) -> str:
  """A command reporting passed/failed `import:<module>` per module (the hidden check; see grade_report)."""
  code = (SCRIPT_REPORTER + "\nimport importlib, sys\nfor m in sys.argv[1:]:\n  try:\n"
          "    importlib.import_module(m)\n    _write('import:' + m, 'passed')\n  except Exception:\n"
          "    _write('import:' + m, 'failed')\n")
  return f"PYTHONPATH={DEPS}:. python -c {shlex.quote(code)} " + " ".join(shlex.quote(m) for m in modules)


def make_setup_task(env: Environment, wheel_dir: str, modules: tuple[str, ...], task_id: str) -> Task:
  """An environment-setup task: after the agent's install, `modules` must import (the hidden check)."""
  if not modules:
    raise ValueError("an environment-setup task needs at least one module whose import proves the install")
  return Task(id=task_id, language="python", prompt=PROMPT.format(wheels=wheel_dir), environment=env,
              tests=HiddenTests(command=_import_check(modules), fail_to_pass=tuple(f"import:{m}" for m in modules),
                                timeout_s=120.0, report="script"),
              metadata={"kind": "env_setup", "wheel_dir": wheel_dir, "changed_files": [INSTALL, VERIFY]})


# ---- the heuristic baseline ------------------------------------------------------------------------------------


def _project_name(manifests: dict[str, str]) -> str | None:
  for path, pattern in (("pyproject.toml", r'^\s*name\s*=\s*["\']([^"\']+)'), ("setup.cfg", r"^\s*name\s*=\s*(\S+)"),
                        ("setup.py", r'name\s*=\s*["\']([^"\']+)')):
    m = re.search(pattern, manifests.get(path, ""), re.MULTILINE)
    if m:
      return m.group(1)
  return None


def heuristic_plan(listing: list[str], manifests: dict[str, str], wheel_dir: str) -> InstallPlan:
  """The baseline: install the project (or its requirements) from the wheel dir, verify by importing it.

  Args:
    listing: top-level entries of the repository (directories end with '/').
    manifests: contents of the manifest files present (see MANIFESTS).
    wheel_dir: local directory of wheels (installs never touch the network).
  """
  pip = (f"python -m pip install --no-index --no-cache-dir --find-links {shlex.quote(wheel_dir)} --target {DEPS} "
         "--no-build-isolation")
  install, imports = [], []
  if "requirements.txt" in manifests:
    install.append(f"{pip} -r requirements.txt")
    imports += [re.split(r"[<>=!~\[; ]", ln.strip())[0].replace("-", "_") for ln in
                manifests["requirements.txt"].splitlines() if ln.strip() and not ln.startswith(("#", "-"))]
  name = _project_name(manifests)
  if name and any(m in manifests for m in ("pyproject.toml", "setup.cfg", "setup.py")):
    install.append(f"{pip} .")
    imports.insert(0, name.replace("-", "_"))
  if "package.json" in manifests:
    install.append("npm ci --offline --ignore-scripts" if "package-lock.json" in listing else
                   "npm install --offline --ignore-scripts")
    main = json.loads(manifests["package.json"] or "{}").get("main")
    if main:
      js = "require(" + json.dumps("./" + main) + ")"
      return InstallPlan(tuple(install), "node -e " + shlex.quote(js))
  if not imports:
    imports = [e.rstrip("/") for e in listing if e.endswith("/") and not e.startswith((".", "test"))][:1]
  verify = f"PYTHONPATH={DEPS}:. python -c " + shlex.quote("; ".join(f"import {m}" for m in imports) or "pass")
  return InstallPlan(tuple(install) or ("true",), verify)


def read_manifests(ws: Workspace) -> tuple[list[str], dict[str, str]]:
  """Top-level listing and manifest contents of a workspace."""
  listing = ws.list_dir(".")
  return listing, {m: ws.read_file(m) for m in MANIFESTS if m in listing}


# ---- validation -------------------------------------------------------------------------------------------------


def plan_from_workspace(ws: Workspace) -> InstallPlan | None:
  """The plan an agent wrote into its workspace, or None if either file is missing."""
  if not (ws.exists(INSTALL) and ws.exists(VERIFY)):
    return None
  return InstallPlan((ws.read_file(INSTALL),), ws.read_file(VERIFY))


def validate_setup(envs: EnvironmentCache, task: Task, plan: InstallPlan | None,
                   timeout_s: float = 600.0) -> SetupResult:
  """Replays `plan` in a fresh fork (see the module docstring); on success returns the installed snapshot."""
  required = list(task.tests.fail_to_pass)
  empty = TestReport(False, 0.0, dict.fromkeys(required, "MISSING"), 0.0)
  if plan is None:
    return SetupResult(False, f"no plan: write both {INSTALL} and {VERIFY}", empty)
  ws = envs.fork(task)
  try:
    ws.write_file(INSTALL, "set -e\n" + "\n".join(plan.install) + "\n")
    ws.write_file(VERIFY, plan.verify + "\n")
    before = ws.run(f"bash {VERIFY}", timeout_s=timeout_s)
    if before.ok:
      return SetupResult(False, "verify passes before installing: it checks nothing (or nothing needs installing)",
                         empty)
    res = ws.run(f"bash {INSTALL}", timeout_s=timeout_s)
    if not res.ok:
      return SetupResult(False, f"install failed (exit {res.exit_code}): {res.output[-300:]}", empty)
    res = ws.run(f"bash {VERIFY}", timeout_s=timeout_s)
    if not res.ok:
      return SetupResult(False, f"verify failed after install (exit {res.exit_code}): {res.output[-300:]}", empty)
    report = grade(ws, task.tests)
    if not report.passed:
      return SetupResult(False, f"hidden check failed: {report.results}", report)
    snapshot = envs.factory.snapshot(ws)
    installed = dataclasses.replace(task.environment, setup=task.environment.setup + tuple(plan.install))
    envs.put(installed, snapshot)
    return SetupResult(True, "", report, installed, snapshot)
  finally:
    ws.close()


def heuristic_setup_policy(wheel_dir: str):
  """The heuristic as a scripted engine policy (prompt text -> assistant message): list the root, read the manifests,
  write install.sh and verify.sh, finish. It reads tool results from its own context, like a model would."""

  def policy(prompt_text: str) -> dict:
    results = [r.split(cf.END_OF_TURN, 1)[0] for r in prompt_text.split(cf.TOOL_RESULT)[1:]]
    step = prompt_text.count(cf.ASSISTANT) - 1

    def call(name, **arguments):
      return {"content": "", "tool_calls": [{"name": name, "arguments": arguments}]}

    if step == 0:
      return call("list_dir")
    listing = results[0].splitlines()
    present = [m for m in MANIFESTS if m in listing]
    if step <= len(present):
      return call("read_file", path=present[step - 1])
    plan = heuristic_plan(listing, dict(zip(present, results[1:1 + len(present)], strict=True)), wheel_dir)
    k = step - len(present)
    if k == 1:
      return call("write_file", path=INSTALL, content="\n".join(plan.install) + "\n")
    if k == 2:
      return call("write_file", path=VERIFY, content=plan.verify + "\n")
    return call("finish", message="Wrote the install and verify commands.")

  return policy
