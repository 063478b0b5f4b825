"""The explicitly unsafe local backend: same interface, copy-based forks, process-group kills, never a default."""

import os

import pytest

import sandboxes
from sandboxes import Limits, SandboxConfig, UnsafeLocalBackend


@pytest.fixture
def backend():
  with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
    be = UnsafeLocalBackend(config=SandboxConfig(limits=Limits(file_size_bytes=1 << 20), output_limit_bytes=100))
  yield be
  be.close()
  assert not os.path.exists(be.path)


def test_not_chosen_silently():
  assert sandboxes.make_backend.__defaults__ == ("bwrap",)
  assert "unsafe" in UnsafeLocalBackend.name


def test_run_fork_snapshot(backend, tmp_path):
  (tmp_path / "a.txt").write_text("a\n")
  snap = backend.import_dir(str(tmp_path))
  with backend.fork(snap) as s1, backend.fork(snap) as s2:
    r = s1.run("cat a.txt; echo b > a.txt; rm -f gone; echo $WORKSPACE")
    assert r.ok and r.stdout_text.splitlines() == ["a", s1.workspace]
    assert s2.read_file("a.txt") == b"a\n"  # independent forks
    s1.write_file("sub/new.txt", "n")
    s1_snap = s1.snapshot()
    with backend.fork(s1_snap) as s3:
      assert s3.read_file("a.txt") == b"b\n" and s3.list_dir() == ["a.txt", "sub"]
  assert (tmp_path / "a.txt").read_text() == "a\n"  # the base dir itself is never touched


def test_limits_timeout_and_output(backend, tmp_path):
  with backend.create(str(tmp_path)) as sb:
    r = sb.run("trap '' TERM; sleep 30", timeout=0.5)
    assert r.timed_out and r.exit_code is None
    r = sb.run("dd if=/dev/zero of=big bs=1M count=3")
    assert r.limit_hit == "file_size" and r.exit_code == 153
    r = sb.run("head -c 1000 /dev/zero")
    assert r.stdout_truncated and len(r.stdout) == 100
    r = sb.run(["no_such_command_xyz"])
    assert r.exit_code == 127
    r = sb.run("exit 7")
    assert r.exit_code == 7


def test_rollout_local_factory_is_this_backend(tmp_path):
  """rollout's LocalFactory is this backend behind the factory interface (one unsafe local workspace, not two)."""
  import sys

  from rollout.workspace import LocalFactory

  (tmp_path / "src").mkdir()
  (tmp_path / "src" / "a.txt").write_text("a\n")
  f = LocalFactory(root=str(tmp_path / "ws"))
  assert isinstance(f.backend, UnsafeLocalBackend)
  ws = f.fork(f.snapshot_from_dir(str(tmp_path / "src")))
  r = ws.run("cat a.txt; echo $PYTHONDONTWRITEBYTECODE; command -v python3")
  assert r.ok and r.output.splitlines()[:2] == ["a", "1"]
  assert r.output.splitlines()[2].startswith(os.path.dirname(sys.executable))  # the caller's python comes first
  ws.write_file("b/c.txt", "c")
  assert ws.list_dir() == ["a.txt", "b/"] and ws.read_file("b/c.txt") == "c"
  with pytest.raises(sandboxes.SandboxError, match="outside the workspace"):
    ws.sb.read_file("../x")
  f.close()
  assert os.listdir(tmp_path / "ws") == []
