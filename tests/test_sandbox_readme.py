"""The sandboxes README's set-up snippet works on any machine as written: it once hard-coded one machine's venv
path, so the sandboxed `python` was not this venv's (or not there at all) elsewhere."""
import ast
import os
import re
import sys

import sandboxes
from sandboxes import Limits, SandboxConfig
from tests.sandbox_testlib import bwrap_backend

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sandboxes", "README.md")


def _readme_config() -> SandboxConfig:
  """The `cfg = SandboxConfig(...)` statement of the README's API snippet, executed as written."""
  snippet = re.search(r"```python\n(.*?)```", open(README).read(), flags=re.S).group(1)
  (stmt,) = [s for s in ast.parse(snippet).body
             if isinstance(s, ast.Assign) and [t.id for t in s.targets if isinstance(t, ast.Name)] == ["cfg"]]
  scope = {"sys": sys, "SandboxConfig": SandboxConfig, "Limits": Limits, "sandboxes": sandboxes}
  exec(compile(ast.Module(body=[stmt], type_ignores=[]), README, "exec"), scope)
  return scope["cfg"]


def test_the_readmes_config_runs_this_venvs_python_and_pytest_in_a_sandbox(tmp_path):
  cfg = _readme_config()
  (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
  with bwrap_backend("readme-", config=cfg) as backend:
    snap = backend.import_dir(str(tmp_path))
    with backend.fork(snap) as sb:
      r = sb.run("python -c 'import sys; print(sys.prefix)'", timeout=60)
      assert r.exit_code == 0 and r.stdout_text.strip() == sys.prefix, r.stderr_text
      r = sb.run("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider test_one.py", timeout=120)
      assert r.exit_code == 0 and "1 passed" in r.stdout_text, r.stdout_text + r.stderr_text
