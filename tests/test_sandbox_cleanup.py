"""Nothing leaks: no mounts, processes, cgroups or dirs after close, a timeout, or a SIGKILL of the parent."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from sandboxes import BwrapBackend, cleanup
from sandboxes.overlay import mounts_under
from tests.sandbox_testlib import ROOT_ONLY, host_procs_with

pytestmark = ROOT_ONLY




def _wait_until(cond, timeout=5.0) -> bool:
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if cond():
      return True
    time.sleep(0.05)
  return cond()


def _state_root() -> str:
  d = tempfile.mkdtemp(prefix="sbx_cleanup_test_")
  os.chmod(d, 0o711)  # the unprivileged sandbox uid must be able to traverse it
  return d


def test_close_leaves_nothing(tmp_path):
  (tmp_path / "a").write_text("a")
  root = _state_root()
  be = BwrapBackend(state_root=root)
  store = be.store.path
  forks = [be.create(str(tmp_path)) for _ in range(3)]
  cgroup_dirs = sorted({d for f in forks for d in f.cgroup.dirs.values()})
  assert cgroup_dirs and all(os.path.isdir(d) for d in cgroup_dirs)
  assert len(mounts_under(store)) >= 3  # one overlay per fork (+ the staged host Python bind, if any)
  r = forks[0].run("sleep 30", timeout=0.5)
  assert r.timed_out and forks[0].cgroup.pids() == set()
  forks[1].close()
  assert not os.path.exists(forks[1].dir)
  be.close()
  assert mounts_under(root) == [] and not os.path.exists(store)
  assert not any(os.path.exists(d) for d in cgroup_dirs)
  for parent in {os.path.dirname(d) for d in cgroup_dirs}:  # the shared parent goes once no sandbox uses it
    assert not os.path.exists(parent) or any(os.path.isdir(os.path.join(parent, c)) for c in os.listdir(parent))
  os.rmdir(root)  # empty: nothing else was left behind


CHILD = textwrap.dedent("""
  import sys, threading
  from sandboxes import BwrapBackend
  be = BwrapBackend(state_root=sys.argv[1])
  sb = be.create(sys.argv[2])
  cmd = "touch started; sleep " + sys.argv[3]
  threading.Thread(target=sb.run, args=(cmd,), kwargs={"timeout": 300}, daemon=True).start()
  print(be.store.path, sb.merged, " ".join(sorted(set(sb.cgroup.dirs.values()))), flush=True)
  threading.Event().wait()
""")


def test_parent_sigkill_then_cleanup(tmp_path):
  (tmp_path / "a").write_text("a")
  root = _state_root()
  marker = f"{os.getpid() % 1000}7.125"
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  child = subprocess.Popen([sys.executable, "-c", CHILD, root, str(tmp_path), marker], stdout=subprocess.PIPE,
                           text=True, cwd=repo, env={**os.environ, "PYTHONPATH": repo})
  try:
    store, workspace, *cgroup_dirs = child.stdout.readline().split()
    # Wait until the command itself runs (not just its launcher), then kill the parent.
    assert _wait_until(lambda: os.path.exists(os.path.join(workspace, "started"))), "the command never started"
    assert host_procs_with(f"sleep {marker}")
    assert mounts_under(store)
    child.send_signal(signal.SIGKILL)
    child.wait()
    # --die-with-parent: the sandbox's whole process tree dies with its parent, before any cleanup runs.
    assert _wait_until(lambda: not host_procs_with(f"sleep {marker}")), "sandboxed process outlived its parent"
    assert os.path.exists(store) and mounts_under(store)  # a SIGKILLed owner cannot unmount...
    assert cleanup(root) == [store]  # ...so the next cleanup (also run when a backend starts) does
    assert mounts_under(root) == [] and not os.path.exists(store)
    assert not any(os.path.exists(d) for d in cgroup_dirs)
  finally:
    if child.poll() is None:
      child.kill()
      child.wait()
    cleanup(root)
    os.rmdir(root)


def test_cleanup_spares_live_owners():
  root = _state_root()
  try:
    be = BwrapBackend(state_root=root)
    assert cleanup(root) == [] and os.path.isdir(be.store.path)
    be2 = BwrapBackend(state_root=root)  # a second backend starting in the same root leaves the first alone
    assert os.path.isdir(be.store.path)
    be2.close()
    be.close()
  finally:
    cleanup(root)
    os.rmdir(root)


def test_close_from_another_thread_kills_the_running_command(tmp_path):
  import threading

  with BwrapBackend() as be:
    sb = be.create(str(tmp_path))
    results = []
    t = threading.Thread(target=lambda: results.append(sb.run("sleep 30", timeout=60)))
    t.start()
    assert _wait_until(lambda: sb.cgroup.pids()), "the command never started"
    t0 = time.monotonic()
    sb.close()
    t.join(10)
    assert time.monotonic() - t0 < 5 and results
    r = results[0]
    assert r.exit_code is None and not r.timed_out and r.limit_hit is None
    assert not os.path.exists(sb.dir)


def test_cli_cleanup_and_run(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": repo}
  root = _state_root()
  try:
    # A store whose owner is gone: a pid that exited (its start time no longer matches anything).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(root, f"{dead.stdout.strip()}-abcdef")
    os.makedirs(os.path.join(stale, "l", "0"))
    with open(os.path.join(stale, "owner"), "w") as f:
      f.write(f"{dead.stdout.strip()} 1\n")
    out = subprocess.run([sys.executable, "-m", "sandboxes", "cleanup", "--state-root", root], capture_output=True,
                         text=True, env=env, cwd=repo)
    assert out.returncode == 0 and out.stdout == f"removed {stale}\n" and not os.path.exists(stale)
    (tmp_path / "x.txt").write_text("hello")
    out = subprocess.run([sys.executable, "-m", "sandboxes", "run", str(tmp_path), "--state-root", root, "--",
                          "sh", "-c", "cat x.txt; exit 3"], capture_output=True, text=True, env=env, cwd=repo)
    assert out.returncode == 3 and out.stdout == "hello"
    assert '"exit_code": 3' in out.stderr and '"limit_hit": null' in out.stderr
  finally:
    cleanup(root)
    os.rmdir(root)
