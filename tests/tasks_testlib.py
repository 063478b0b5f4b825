"""Small git repositories built by tests (tasks, miner, evaluation), and the fast miner settings they use."""

import subprocess

from rollout.tasks import miner

# Plugins of the surrounding venv are not needed by these tests and double pytest's start-up.
FAST = miner.MinerConfig(test_command="PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " + miner.MinerConfig().test_command,
                         progress=False)


def git(repo, *args: str) -> str:
  return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def init_repo(path) -> str:
  subprocess.run(["git", "init", "-q", "-b", "main", str(path)], check=True)
  return str(path)


def commit(repo, files: dict, message: str, body: str = "") -> str:
  """Writes `files` (path -> text; None deletes), commits them with `message` (+ `body`), returns the sha."""
  for path, text in files.items():
    p = repo / path
    if text is None:
      p.unlink()
      continue
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
  subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
  subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message,
                  *(["-m", body] if body else [])],
                 check=True)
  return git(repo, "rev-parse", "HEAD").strip()


def sandbox_factory():
  """A `rollout.workspace.SandboxFactory` (bubblewrap), or the calling test skipped with the reason it cannot run."""
  import pytest
  sandboxes = pytest.importorskip("sandboxes")
  from rollout.workspace import SandboxFactory
  try:
    return SandboxFactory()
  except sandboxes.BackendUnavailableError as e:
    pytest.skip(f"no namespaced sandboxes on this machine: {e}")


def swe_set(root, n: int) -> tuple[str, str]:
  """A SWE-bench-style JSONL file of `n` instances against one repository (`root`/acme__calc, one base commit):
  instance i's `f{i}` returns a wrong constant, its gold patch fixes that line and its test patch adds the test
  that fails before the fix. Returns (the JSONL path, the repos_dir)."""
  import json
  repo = root / "acme__calc"
  init_repo(repo)
  source = "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(n))
  base = commit(repo, {"calc.py": source, "tests/__init__.py": ""}, "Base")
  instances = []
  for i in range(n):
    (repo / "calc.py").write_text(source.replace(f"return {i}\n", f"return {i + 100}\n"))
    patch = git(repo, "diff")
    git(repo, "checkout", "-q", "--", "calc.py")
    test = f"tests/test_f{i}.py"
    (repo / test).write_text(f"from calc import f{i}\n\n\ndef test_f{i}():\n    assert f{i}() == {i + 100}\n")
    git(repo, "add", "-N", test)
    test_patch = git(repo, "diff")
    git(repo, "rm", "-q", "--cached", test)
    (repo / test).unlink()
    instances.append({"instance_id": f"acme__calc-{i}", "repo": "acme/calc", "base_commit": base, "patch": patch,
                      "test_patch": test_patch, "FAIL_TO_PASS": [f"{test}::test_f{i}"], "PASS_TO_PASS": [],
                      "problem_statement": f"f{i}() should return {i + 100}"})
  path = root / "instances.jsonl"
  path.write_text("".join(json.dumps(inst) + "\n" for inst in instances))
  return str(path), str(root)
