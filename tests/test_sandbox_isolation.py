"""Isolation of the bwrap backend, checked with real processes: network, filesystem, capabilities, namespaces."""

import os
import socket
import sys

import pytest

from sandboxes import SandboxConfig, bwrap
from tests.sandbox_testlib import ROOT_ONLY, backend_fixture

pytestmark = ROOT_ONLY


backend = backend_fixture()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  d = tmp_path_factory.mktemp("base")
  (d / "hello.txt").write_text("hi\n")
  return str(d)


@pytest.fixture
def sb(backend, base):
  with backend.create(base) as s:
    yield s


def test_runs_as_unprivileged_user_in_workspace(sb):
  r = sb.run("id -u; id -g; pwd; cat hello.txt")
  assert r.ok, r.stderr_text
  assert r.stdout_text.split() == ["1000", "1000", "/workspace", "hi"]


def test_no_network_to_host_loopback(sb):
  with socket.socket() as srv:
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
    r = sb.run(["python3", "-c", code], timeout=10)
  assert r.exit_code != 0
  assert b"connected" not in r.stdout
  assert b"ConnectionRefusedError" in r.stderr or b"Network is unreachable" in r.stderr, r.stderr_text
  r = sb.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
  assert r.stdout_text.split() == ["lo"]  # a fresh net namespace has only its own loopback


def test_network_opt_in_reaches_host_loopback(backend, base):
  # The positive control for the test above: the same connect works when the network is explicitly shared.
  with socket.socket() as srv, backend.fork(backend.import_dir(base), SandboxConfig(network=True)) as s:
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    code = f"import socket; socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=5); print('ok')"
    r = s.run(["python3", "-c", code], timeout=10)
    assert r.stdout == b"ok\n", r.stderr_text


@pytest.mark.parametrize(
  "path", ["/etc/x", "/usr/x", "/x", "/root/x", "/proc/sys/vm/swappiness", "/proc/sys/kernel/core_pattern"])
def test_writes_outside_workspace_fail(sb, path):
  # Kernel sysctls are the classic escape when the sandbox user is root outside; here it is an unprivileged uid.
  before = open(path).read() if path.startswith("/proc") else None
  r = sb.run(f"echo 1 > {path}")
  assert r.exit_code != 0
  assert ("Read-only file system" in r.stderr_text) or ("Permission denied" in r.stderr_text), r.stderr_text
  if before is None:
    assert not os.path.exists(path)
  else:
    assert open(path).read() == before


def test_private_tmp_and_workspace_are_writable(sb):
  r = sb.run("echo a > /tmp/t && cat /tmp/t && echo b > w.txt && cat w.txt")
  assert r.ok and r.stdout_text.split() == ["a", "b"]
  assert sb.read_file("w.txt") == b"b\n"


def test_host_files_invisible(sb, backend, base, tmp_path):
  secret = tmp_path / "host_secret.txt"
  secret.write_text("secret")
  other = backend.create(base)
  try:
    other.write_file("other_marker.txt", "x")
    other_host_path = os.path.join(other.merged, "other_marker.txt")
    assert os.path.exists(other_host_path)
    r = sb.run(f"test -e {secret}; echo $?; test -e {other_host_path}; echo $?; ls -A /root; "
               "test -e /etc/shadow; echo $?; test -e /work; echo $?")
    assert r.ok, r.stderr_text
    lines = r.stdout_text.split()
    assert lines[:2] == ["1", "1"]  # a host file and another sandbox's workspace
    # /root holds only the dirs leading to the bound Python prefix (if it lives there), nothing else of root's.
    prefixes = [p for p in bwrap.python_prefixes() if p.startswith("/root/")]
    expected_root = sorted({p.split("/")[2] for p in prefixes})
    assert lines[2:-2] == expected_root
    assert lines[-2:] == ["1", "1"]
  finally:
    other.close()


def test_no_capabilities_and_no_nested_userns(sb):
  r = sb.run("grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status")
  caps = dict(line.split(":") for line in r.stdout_text.strip().splitlines())
  assert len(caps) == 5 and all(int(v.strip(), 16) == 0 for v in caps.values()), caps
  r = sb.run("unshare --user true")  # nested user namespaces are disabled (--disable-userns)
  assert r.exit_code != 0
  r = sb.run("grep NoNewPrivs /proc/self/status")
  assert r.stdout_text.split() == ["NoNewPrivs:", "1"]


def test_every_namespace_is_new(sb):
  kinds = ["cgroup", "ipc", "mnt", "net", "pid", "user", "uts"]
  r = sb.run("for k in " + " ".join(kinds) + "; do readlink /proc/self/ns/$k; done; hostname")
  assert r.ok, r.stderr_text
  *inside, hostname = r.stdout_text.split()
  host = [os.readlink(f"/proc/self/ns/{k}") for k in kinds]
  assert len(inside) == len(kinds)
  for k, a, b in zip(kinds, inside, host, strict=True):
    assert a != b, f"the sandbox shares the host's {k} namespace"
  assert hostname == "sandbox"


def test_own_pid_namespace(sb):
  r = sb.run("ls /proc | grep -E '^[0-9]+$' | wc -l")
  assert int(r.stdout_text) < 10  # only the sandbox's few processes, not the host's
  assert os.getpid() > 0  # the parent survives every test in this file


def test_host_python_and_extra_ro_binds(backend, base, tmp_path):
  tool = tmp_path / "tools"
  tool.mkdir()
  (tool / "mytool").write_text("#!/bin/sh\necho tool-ran\n")
  (tool / "mytool").chmod(0o755)
  cfg = SandboxConfig(ro_binds=(str(tool),), path_prefix=(str(tool),))
  with backend.fork(backend.import_dir(base), cfg) as s:
    r = s.run("python3 -c 'import sys; print(sys.version_info[0])'; mytool; touch " + str(tool / "new"))
    assert r.stdout_text.split() == ["3", "tool-ran"]
    assert r.exit_code != 0 and not (tool / "new").exists()  # the extra bind is read-only


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the tests are not running from a venv to share")
def test_venv_python_and_ruff_through_ro_binds(backend, base):
  venv = sys.prefix
  cfg = SandboxConfig(ro_binds=(venv,), path_prefix=(os.path.join(venv, "bin"),))
  with backend.fork(backend.import_dir(base), cfg) as s:
    s.write_file("bad.py", "import os\n")
    r = s.run("python -c 'import numpy, sys; print(sys.prefix == sys.base_prefix)'; ruff check --no-cache -q bad.py",
              timeout=60)
    assert r.stdout_text.splitlines()[0] == "False", r.stderr_text  # the venv's python, with its packages
    assert r.exit_code == 1 and "F401" in r.stdout_text, r.stdout_text + r.stderr_text  # ruff ran and found it
