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
