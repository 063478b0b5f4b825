"""Regression tests for the holes an attack run found and the API bugs found with it (each failed before its fix).

Holes: the host environment visible in /proc/1/environ, `disk_bytes` bypassed by deep paths and many empty files,
cleanup broken by a 1,200-deep tree, host-side file calls hanging on a FIFO (and racing a symlink swap), and a
cross-sandbox channel through the kernel keyring.
"""

import ctypes
import errno
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from sandboxes import BwrapBackend, Limits, SandboxConfig, SandboxError, cleanup, fsops, store
from sandboxes.overlay import mounts_under
from tests.sandbox_testlib import ROOT_ONLY, sandbox_with_file

pytestmark = ROOT_ONLY

MiB = 1 << 20


@pytest.fixture(scope="module")
def state_root():
  # On tmpfs: deleting thousands of entries from this machine's root disk (mounted with discard) takes seconds.
  d = tempfile.mkdtemp(prefix="sbx_hardening_", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
  os.chmod(d, 0o711)  # the unprivileged sandbox uid must traverse it
  yield d
  shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def backend(state_root):
  be = BwrapBackend(state_root=state_root)
  yield be
  be.close()


@pytest.fixture
def sb(backend, tmp_path):
  with sandbox_with_file(backend, tmp_path) as s:
    yield s


# -- 1. the host environment -------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["exec", "preexec"])
def test_host_environment_is_not_visible_inside(state_root, tmp_path, monkeypatch, launcher):
  monkeypatch.setenv("COMPOSER_CANARY_SECRET", "hunter2-canary")
  with BwrapBackend(state_root=state_root, launcher=launcher) as be, be.create(str(tmp_path)) as s:
    r = s.run("for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done; env")
  assert r.exit_code == 0, r.stderr_text
  assert "hunter2-canary" not in r.stdout_text and "COMPOSER_CANARY_SECRET" not in r.stdout_text
  assert "WORKSPACE=/workspace" in r.stdout_text  # the command's own environment is still there


# -- 2. disk and inode limits enforced by the kernel -------------------------------------------------------
DEEP = "d=$(printf 'a%.0s' $(seq 250)); for i in $(seq 18); do mkdir $d && cd $d || exit 9; done; "


def test_disk_bytes_holds_below_paths_longer_than_path_max(backend, tmp_path):
  cfg = SandboxConfig(limits=Limits(disk_bytes=16 * MiB))
  with backend.create(str(tmp_path), cfg) as s:
    r = s.run(DEEP + "head -c 64M /dev/zero > f; echo rc=$?; stat -c %s f", timeout=60)
    assert r.limit_hit == "disk", (r, r.stderr_text)
    size = int(r.stdout_text.split()[-1])
    assert size <= 16 * MiB  # ENOSPC at write time: no overshoot at all
    assert "No space left" in r.stderr_text
    assert s.run("echo more > g").limit_hit == "disk"  # the fork stays full until files are removed
    s.run("rm -rf a*")
    assert s.run("head -c 1M /dev/zero > g").ok


def test_disk_inodes_limit(backend, tmp_path):
  cfg = SandboxConfig(limits=Limits(disk_inodes=1000))
  with backend.create(str(tmp_path), cfg) as s:
    r = s.run("for i in $(seq 3000); do : > f$i 2>/dev/null || { echo full at $i; break; }; done", timeout=60)
    assert r.limit_hit == "inodes" and "full at" in r.stdout_text, r
    assert int(r.stdout_text.split()[-1]) <= 1001


# -- 3. cleanup of deep trees ------------------------------------------------------------------------------
def test_deep_tree_does_not_break_close_snapshot_or_cleanup(backend, state_root, tmp_path):
  s = backend.create(str(tmp_path))
  assert s.run("mkdir -p $(printf 'd/%.0s' $(seq 1200))", timeout=120).ok  # one mkdir: a cd loop is quadratic
  snap = s.snapshot()  # the deep tree now also lives in a layer on disk
  s.close()
  backend.delete_snapshot(snap)
  assert not os.path.exists(snap.layers[0])  # its own layer (the imported base stays with its snapshot)
  assert backend.create(str(tmp_path)).run("true").ok  # the backend still works


def _deep_tree(root: str, depth: int) -> None:
  """`depth` nested dirs below `root` (paths far over PATH_MAX), made with dir fds."""
  fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
  for _ in range(depth):
    os.mkdir("d", dir_fd=fd)
    nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = nfd
  with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
    f.write("x")
  os.close(fd)


def _dead_store(root: str, name: str) -> str:
  path = os.path.join(root, name)
  os.makedirs(os.path.join(path, "l"))
  with open(os.path.join(path, "owner"), "w") as f:
    f.write("999999999 0\n")  # no such process
  return path


def test_cleanup_removes_deep_stale_stores_and_one_failure_does_not_block_others(monkeypatch):
  root = tempfile.mkdtemp(prefix="sbx_deep_", dir="/tmp")
  try:
    deep, plain, bad = (_dead_store(root, n) for n in ("1-deep", "2-plain", "3-bad"))
    _deep_tree(os.path.join(deep, "l"), 1500)
    real_remove = store.remove_store

    def remove_store(path):
      if path == bad:
        raise OSError(errno.EBUSY, "simulated: stuck mount")
      real_remove(path)

    monkeypatch.setattr(store, "remove_store", remove_store)
    with pytest.warns(RuntimeWarning, match="3-bad"):
      removed = cleanup(root)
    assert sorted(removed) == [deep, plain]
    assert os.listdir(root) == ["3-bad"]
  finally:
    shutil.rmtree(root, ignore_errors=True)


def test_rmtree_finishes_when_another_cleanup_deletes_the_same_tree(tmp_path, monkeypatch):
  """Two cleanups removing one dead store at once: every file, directory and subtree the other deletes between
  this one's listing and its own unlink, rmdir or open is skipped, not an error (it was a warning per store)."""
  d = tmp_path / "store"
  for sub in ("l/0/a", "l/1/b", "s/0/u"):
    (d / sub).mkdir(parents=True)
    (d / sub / "f").write_text("x")
  real_unlink, real_rmdir, real_open = os.unlink, os.rmdir, fsops._open_dir
  raced = []

  def other_first(real):
    def call(name, *a, **k):
      real(name, *a, **k)          # the other cleanup gets there first...
      raced.append(name)
      return real(name, *a, **k)   # ...so ours finds it gone
    return call

  def open_after_other_deleted(dir_fd, name):
    if name == "1":                # the other cleanup deleted the whole subtree l/1 after we listed l/
      subprocess.run(["rm", "-rf", str(d / "l" / "1")], check=True)
    return real_open(dir_fd, name)

  monkeypatch.setattr(fsops.os, "unlink", other_first(real_unlink))
  monkeypatch.setattr(fsops.os, "rmdir", other_first(real_rmdir))
  monkeypatch.setattr(fsops, "_open_dir", open_after_other_deleted)
  fsops.rmtree(str(d))
  monkeypatch.undo()
  assert not d.exists() and "f" in raced and "store" in raced


def test_rmtree_reference_on_awkward_trees(tmp_path):
  """The iterative deletion against shutil.rmtree on what both can delete (read-only dirs, links, FIFOs)."""
  for i, make in enumerate([lambda d: None, lambda d: _deep_tree(d, 50)]):
    d = tmp_path / f"t{i}"
    (d / "a" / "b").mkdir(parents=True)
    (d / "a" / "f").write_text("f")
    os.symlink("/etc", d / "a" / "etc_link")  # must be unlinked, never followed
    os.mkfifo(d / "a" / "fifo")
    os.chmod(d / "a" / "b", 0o500)
    make(str(d / "a" / "b"))
    fsops.rmtree(str(d))
    assert not d.exists() and os.path.isdir("/etc")


# -- 4. special files and symlink races in host-side file calls --------------------------------------------
def _in_thread(fn, timeout=5.0):
  out = {}

  def target():
    try:
      out["value"] = fn()
    except BaseException as e:
      out["error"] = e

  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(timeout)
  return t, out


def test_fifo_does_not_hang_host_file_calls(sb):
  assert sb.run("mkfifo results.json && mkfifo in.txt").ok
  host = os.path.join(sb._root(), "results.json")
  t, out = _in_thread(lambda: sb.read_file("results.json"))
  if t.is_alive():  # the bug: unblock the reader so the module can tear down, then fail
    os.close(os.open(host, os.O_WRONLY | os.O_NONBLOCK))
    t.join(5)
    pytest.fail("read_file blocked on a FIFO")
  assert isinstance(out.get("error"), SandboxError) and "not a regular file" in str(out["error"])
  t, out = _in_thread(lambda: sb.write_file("in.txt", "x"))
  if t.is_alive():
    os.close(os.open(os.path.join(sb._root(), "in.txt"), os.O_RDONLY | os.O_NONBLOCK))
    t.join(5)
    pytest.fail("write_file blocked on a FIFO")
  assert isinstance(out.get("error"), SandboxError) and "not a regular file" in str(out["error"])
  assert sb.run("true").ok  # and the sandbox lock is free


def test_symlink_swap_race_never_reaches_the_host(tmp_path):
  root, host = tmp_path / "root", tmp_path / "host"
  (root / "real").mkdir(parents=True)
  (root / "real" / "f").write_text("inside")
  host.mkdir()
  (host / "f").write_text("HOST")
  os.symlink(str(host), root / "link")
  stop = threading.Event()
  libc = ctypes.CDLL(None, use_errno=True)
  rename_exchange = 2  # renameat2(RENAME_EXCHANGE): "d" always exists, as the real dir or as the link

  os.rename(root / "real", root / "d")

  def swapper():
    while not stop.is_set():
      libc.renameat2(-100, str(root / "d").encode(), -100, str(root / "link").encode(), rename_exchange)

  t = threading.Thread(target=swapper, daemon=True)
  t.start()
  seen = {"inside": 0, "HOST": 0, "error": 0}
  try:
    for _ in range(20_000):
      try:
        seen[fsops.read_file(str(root), "d/f").decode()] += 1
      except (OSError, SandboxError):
        seen["error"] += 1
  finally:
    stop.set()
    t.join()
  assert seen["HOST"] == 0, seen


# -- 5. seccomp --------------------------------------------------------------------------------------------
def _nr(name: str) -> int:
  import pyseccomp

  return pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)


DENIED = ("add_key", "keyctl", "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load",
          "kexec_file_load", "open_by_handle_at", "init_module", "finit_module", "delete_module", "mount", "umount2",
          "pivot_root", "fsopen", "fsmount", "open_tree", "move_mount", "unshare", "setns", "io_uring_setup",
          "swapon", "reboot", "modify_ldt")

PROBE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for name, nr in zip(sys.argv[1::2], sys.argv[2::2]):
  rc = libc.syscall(int(nr), 0, 0, 0, 0, 0)
  print(name, rc, os.strerror(ctypes.get_errno()) if rc < 0 else "ok")
"""


def test_seccomp_denies_the_docker_default_list(sb):
  args = [a for name in DENIED for a in (name, str(_nr(name)))]
  r = sb.run(["python3", "-c", PROBE] + args)
  assert r.exit_code == 0, r.stderr_text
  rows = {line.split()[0]: line.split(None, 2)[1:] for line in r.stdout_text.splitlines()}
  assert sorted(rows) == sorted(DENIED)
  assert all(rows[n] == ["-1", os.strerror(errno.EPERM)] for n in DENIED), rows
  assert sb.run(["python3", "-c", "import os, subprocess; subprocess.run(['true'], check=True)"]).ok  # clone works


OPEN_TREE_ATTR = 467  # one number on every architecture (syscalls >= 424); libseccomp < 2.6 has no name for it
OPEN_TREE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(int(sys.argv[1]), -100, b"/", 0, None, 0)  # AT_FDCWD, no clone: an O_PATH fd, no privilege
print(fd if fd < 0 else 0, ctypes.get_errno() if fd < 0 else 0)
"""


def test_seccomp_denies_open_tree_attr_like_the_other_mount_calls(sb):
  host = subprocess.run([sys.executable, "-c", OPEN_TREE, str(OPEN_TREE_ATTR)], capture_output=True, text=True)
  if host.stdout.split() == ["-1", str(errno.ENOSYS)]:
    pytest.skip("this kernel has no open_tree_attr (Linux < 6.15)")
  assert host.stdout.split() == ["0", "0"], host  # allowed outside: the filter is what denies it inside
  assert sb.run(["python3", "-c", OPEN_TREE, str(OPEN_TREE_ATTR)]).stdout_text.split() == ["-1", str(errno.EPERM)]


KEYRING = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.syscall(int(sys.argv[1]), b"user", b"composer_channel", b"secret", 6, -4)  # KEY_SPEC_USER_KEYRING
print(rc, ctypes.get_errno())
"""


def test_keyring_is_no_channel_between_forks(backend, tmp_path):
  with backend.create(str(tmp_path)) as a, backend.create(str(tmp_path)) as b:
    r = a.run(["python3", "-c", KEYRING, str(_nr("add_key"))])
    assert r.stdout_text.split() == ["-1", str(errno.EPERM)], r
    seen = b.run("cat /proc/keys 2>/dev/null; true").stdout_text
    assert "composer_channel" not in seen


# -- API bugs ----------------------------------------------------------------------------------------------
def test_paths_are_normalised_before_the_workspace_prefix_is_stripped(sb):
  sb.write_file("/workspace/../workspace/z", "z")
  assert sb.read_file("z") == b"z" and not sb.exists("workspace")
  sb.write_file("a/../b", "b")
  assert sb.read_file("b") == b"b"


@pytest.mark.parametrize("path", ["../../etc/x", "..", "a/../../x", "/workspace/../etc/x", "/etc/x"])
def test_paths_leaving_the_workspace_are_refused(sb, path):
  with pytest.raises(SandboxError, match="outside the workspace"):
    sb.write_file(path, "x")
  with pytest.raises(SandboxError, match="outside the workspace"):
    sb.read_file(path)
  assert not sb.exists("etc") and not sb.exists("x")


def test_symlink_with_dotdot_above_the_root_is_refused(sb):
  assert sb.run("ln -s ../../.. up && ln -s /workspace/f.txt abs").ok
  with pytest.raises(SandboxError, match="outside the workspace"):
    sb.read_file("up/etc/passwd")
  assert sb.read_file("abs") == b"content\n"  # links within the workspace still work


def test_file_calls_take_path_objects(sb):
  sb.write_file(pathlib.Path("p/q.txt"), "q")
  sb.write_file(pathlib.PurePosixPath("/workspace/p/r.txt"), b"r")
  assert sb.read_file(pathlib.Path("p/q.txt")) == b"q" and sb.exists(pathlib.Path("p/r.txt"))
  assert sb.list_dir(pathlib.Path("p")) == ["q.txt", "r.txt"]
  sb.remove(pathlib.Path("p/q.txt"))
  assert sb.list_dir(pathlib.Path("p")) == ["r.txt"]
  with pytest.raises(ValueError, match="path must be"):
    sb.read_file(3)


def test_trailing_slash_is_not_a_file_name(sb):
  with pytest.raises(IsADirectoryError):
    sb.write_file("newdir/", "x")
  assert not sb.exists("newdir")


@pytest.mark.parametrize("kwargs, match", [
  ({"cmd": ["echo"] * 9500}, "arguments"),
  ({"cmd": ["echo", "x" * 200_000]}, r"cmd\[1\]"),
  ({"cmd": "true", "env": {"A=B": "x"}}, "env key 'A=B'"),
  ({"cmd": "true", "env": {"": "x"}}, "env key ''"),
  ({"cmd": "true", "env": {"BIG": "x" * 200_000}}, "env\\['BIG'\\]"),
  ({"cmd": "true", "timeout": float("inf")}, "timeout"),
  ({"cmd": None}, "cmd must be"),
  ({"cmd": "true", "stdin": "text"}, "stdin must be bytes"),
])
def test_invalid_run_arguments_raise_before_launching(sb, kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    sb.run(**kwargs)


def test_invalid_limits_and_config_are_refused():
  with pytest.raises(ValueError, match="max_pids"):
    Limits(max_pids=1.5)
  with pytest.raises(ValueError, match="memory_bytes"):
    Limits(memory_bytes=True)
  with pytest.raises(ValueError, match="cpu_seconds"):
    Limits(cpu_seconds=float("nan"))
  with pytest.raises(ValueError, match="whole host"):
    SandboxConfig(ro_binds=("/",))
  with pytest.raises(ValueError, match="SandboxConfig.env key 'A=B'"):
    SandboxConfig.make(env={"A=B": "x"})


def test_ro_bind_exposing_the_state_root_is_refused(backend, state_root, tmp_path):
  with pytest.raises(ValueError, match="state root"):
    backend.create(str(tmp_path), SandboxConfig(ro_binds=(os.path.dirname(state_root),)))


def test_failing_constructor_leaves_no_state_root_behind():
  parent = tempfile.mkdtemp(prefix="sbx_ctor_", dir="/tmp")
  os.chmod(parent, 0o700)  # the sandbox uid cannot traverse: the constructor fails after making the state root
  root = os.path.join(parent, "state")
  try:
    with pytest.raises(SandboxError, match="cannot enter"):
      BwrapBackend(state_root=root)
    assert not os.path.exists(root)
  finally:
    shutil.rmtree(parent)


def test_dev_is_read_only_and_dev_shm_is_capped(backend, tmp_path):
  cfg = SandboxConfig(limits=Limits(tmp_bytes=8 * MiB))
  with backend.create(str(tmp_path), cfg) as s:
    r = s.run("head -c 32M /dev/zero > /dev/shm/x; stat -c %s /dev/shm/x; touch /dev/new && echo wrote-dev")
    assert int(r.stdout_text.split()[0]) <= 8 * MiB and "wrote-dev" not in r.stdout_text, r


def test_no_sandbox_mount_left_after_close(backend, tmp_path):
  s = backend.create(str(tmp_path))
  d = s.dir
  assert mounts_under(d)
  s.close()
  assert mounts_under(d) == [] and not os.path.exists(d)


def test_staged_etc_holds_only_world_readable_host_files(tmp_path):
  from sandboxes import bwrap

  host = tmp_path / "host_etc"
  (host / "ssl" / "certs").mkdir(parents=True)
  (host / "ssl" / "certs" / "ca.pem").write_text("public")
  os.symlink("ca.pem", host / "ssl" / "certs" / "link.pem")
  (host / "ssl" / "private").mkdir(mode=0o700)
  (host / "ssl" / "private" / "key.pem").write_text("secret")
  (host / "hosts").write_text("127.0.0.1 localhost hostbox")
  (host / "profile").write_text("root only")
  os.chmod(host / "profile", 0o600)
  bwrap.stage_etc(str(tmp_path / "etc"), host_etc=str(host))
  got = sorted(str(p.relative_to(tmp_path / "etc")) for p in (tmp_path / "etc").rglob("*"))
  assert got == ["group", "hosts", "passwd", "ssl", "ssl/certs", "ssl/certs/ca.pem", "ssl/certs/link.pem"]
  assert os.readlink(tmp_path / "etc" / "ssl" / "certs" / "link.pem") == "ca.pem"
  assert "hostbox" not in (tmp_path / "etc" / "hosts").read_text()  # the host's names stay out
