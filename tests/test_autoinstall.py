"""rollout/tasks/autoinstall.py: the heuristic plan, validation in a fresh fork (with its rejections), the saved
snapshot reused by other tasks, and the same task driven through the harness."""

import zipfile

import pytest

from composer_jax.train import tokenizer as tokenizer_lib
from rollout import harness
from rollout.engines import scripted
from rollout.tasks import autoinstall
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Environment, HiddenTests, Task
from rollout.workspace import LocalFactory


def _wheel(directory, name="tinydep", version="0.1"):
  """A minimal pure-Python wheel, written by hand (no network, no build tools)."""
  path = directory / f"{name}-{version}-py3-none-any.whl"
  info = f"{name}-{version}.dist-info"
  with zipfile.ZipFile(path, "w") as z:
    z.writestr(f"{name}/__init__.py", "X = 42\n")
    z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{info}/RECORD", "")
  return path


PYPROJECT = """[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "appx"
version = "0.1"
dependencies = ["tinydep"]
"""


@pytest.fixture(scope="module")
def setup_env(tmp_path_factory):
  root = tmp_path_factory.mktemp("ai")
  wheels = root / "wheels"
  wheels.mkdir()
  _wheel(wheels)
  proj = root / "proj"
  (proj / "src" / "appx").mkdir(parents=True)
  (proj / "pyproject.toml").write_text(PYPROJECT)
  (proj / "src" / "appx" / "__init__.py").write_text("import tinydep\n\nVALUE = tinydep.X\n")
  env = Environment(base_dir=str(proj))
  task = autoinstall.make_setup_task(env, str(wheels), ("appx", "tinydep"), "setup/appx")
  envs = EnvironmentCache(LocalFactory(root=str(root / "ws")))
  return task, envs, str(wheels)


def test_heuristic_plan_detects_manifests():
  pip = ("python -m pip install --no-index --no-cache-dir --find-links /w --target .deps --no-build-isolation")
  plan = autoinstall.heuristic_plan(["pyproject.toml", "src/"], {"pyproject.toml": PYPROJECT}, "/w")
  assert plan == autoinstall.InstallPlan((f"{pip} .",), "PYTHONPATH=.deps:. python -c 'import appx'")
  plan = autoinstall.heuristic_plan(["requirements.txt", "tool.py"], {"requirements.txt": "# c\nfoo-bar>=1\nbaz\n"},
                                    "/w")
  assert plan == autoinstall.InstallPlan((f"{pip} -r requirements.txt",),
                                         "PYTHONPATH=.deps:. python -c 'import foo_bar; import baz'")
  plan = autoinstall.heuristic_plan(["package.json", "package-lock.json"], {"package.json": '{"main": "i.js"}'}, "/w")
  assert plan == autoinstall.InstallPlan(("npm ci --offline --ignore-scripts",), "node -e 'require(\"./i.js\")'")


def test_validate_heuristic_plan_and_reuse_snapshot(setup_env):
  task, envs, wheels = setup_env
  ws = envs.fork(task)
  plan = autoinstall.heuristic_plan(*autoinstall.read_manifests(ws), wheels)
  ws.close()
  result = autoinstall.validate_setup(envs, task, plan)
  assert result.ok, result.reason
  assert result.report.results == {"import:appx": "PASSED", "import:tinydep": "PASSED"}
  # Another task on the installed environment starts from the saved snapshot: no setup is rerun.
  other = Task("uses-appx", "python", "p", result.environment,
               HiddenTests("PYTHONPATH=.deps:. python -c 'import appx; print(\"PASSED v\", appx.VALUE)'", ("v",)))
  ws = envs.fork(other)
  assert ws.exists(".deps/tinydep/__init__.py")
  assert ws.run(other.tests.command).output.strip() == "PASSED v 42"
  ws.close()


def test_validate_rejects_bad_plans(setup_env):
  task, envs, wheels = setup_env
  cases = [
    (None, "no plan"),
    (autoinstall.InstallPlan(("true",), "true"), "verify passes before installing"),
    (autoinstall.InstallPlan(("python -m pip install --no-index --find-links /nonexistent --target .deps nothing",),
                             "python -c 'import appx'"), "install failed"),
    (autoinstall.InstallPlan(("mkdir -p .deps",), "PYTHONPATH=.deps:src python -c 'import tinydep'"),
     "verify failed after install"),
  ]
  for plan, reason in cases:
    result = autoinstall.validate_setup(envs, task, plan)
    assert not result.ok and result.reason.startswith(reason), (plan, result.reason)
    assert result.snapshot is None


def test_setup_task_through_the_harness(setup_env):
  task, envs, wheels = setup_env
  tok = tokenizer_lib.train_tokenizer([PYPROJECT, task.prompt], tokenizer_lib.TokenizerConfig(400))
  cfg = harness.HarnessConfig(context_budget=4096, max_turn_tokens=512, observation_reserve=512)
  engine = scripted.ScriptedEngine(tok, autoinstall.heuristic_setup_policy(wheels))
  (t,) = harness.run_episodes(engine, tok, [task], envs, cfg)
  assert t.metrics["solved"] == 1.0, t.metrics
  assert [m["tool_calls"][0]["name"] for m in t.messages if m["role"] == "assistant"] == [
    "list_dir", "read_file", "write_file", "write_file", "finish"]
  (t,) = harness.run_episodes(scripted.ScriptedEngine(tok, scripted.noop_policy), tok, [task], envs, cfg)
  assert t.metrics["solved"] == 0.0 and t.metrics["grade_error"].startswith("no plan")
