"""cgroup layouts: detection from mountinfo, the files written for v1 and v2, and the real v1 groups here."""

import os
import resource

from sandboxes import BwrapBackend, Limits, SandboxConfig
from sandboxes.limits import SandboxCgroup, detect_parents, rlimits_for
from tests.sandbox_testlib import ROOT_ONLY

MiB = 1 << 20
LIM = Limits(memory_bytes=64 * MiB, max_pids=7, cpus=0.5)

# This machine's layout (trimmed): v1 per controller, v2 mounted with no useful controller.
V1_MOUNTINFO = """\
31 23 0:28 / {root} rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / {root}/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / {root}/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
36 31 0:33 / {root}/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / {root}/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_CGROUP = "8:pids:/\n4:memory:/jobs/j1\n2:cpuacct:/\n1:cpu:/\n0::/\n"
# A typical systemd host: pure v2.
V2_MOUNTINFO = "30 23 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V2_CGROUP = "0::/system.slice/x.service\n"


def _mkdirs(*paths):
  for p in paths:
    os.makedirs(p, exist_ok=True)


def test_detect_v1_nests_under_own_cgroup(tmp_path):
  r = str(tmp_path)
  _mkdirs(f"{r}/cpu", f"{r}/cpuacct", f"{r}/memory/jobs/j1", f"{r}/pids", f"{r}/unified")
  with open(f"{r}/unified/cgroup.controllers", "w") as f:
    f.write("hugetlb\n")
  got = detect_parents(V1_MOUNTINFO.format(root=r), V1_CGROUP)
  assert got == {"cpu": f"{r}/cpu", "cpuacct": f"{r}/cpuacct", "memory": f"{r}/memory/jobs/j1", "pids": f"{r}/pids"}


def test_detect_v2(tmp_path):
  r = str(tmp_path)
  _mkdirs(f"{r}/system.slice/x.service")
  with open(f"{r}/cgroup.controllers", "w") as f:
    f.write("cpuset cpu io memory pids\n")
  got = detect_parents(V2_MOUNTINFO.format(root=r), V2_CGROUP)
  own = f"{r}/system.slice/x.service"
  assert got == {"memory": own, "pids": own, "cpu": own, "cpuacct": own}


def _read(p):
  with open(p) as f:
    return f.read()


def test_v1_files(tmp_path):
  # A directory shaped like v1 cgroupfs (no cgroup.controllers); the kernel would create these files on mkdir.
  r = str(tmp_path)
  parents = {c: f"{r}/{c}" for c in ("memory", "pids", "cpu", "cpuacct")}
  _mkdirs(*(f"{p}/composer_sandboxes/g" for p in parents.values()))
  with open(f"{r}/cpuacct/composer_sandboxes/g/cpuacct.usage", "w") as f:
    f.write("2500000000\n")
  cg = SandboxCgroup("g", LIM, parents)
  g = "composer_sandboxes/g"
  assert _read(f"{r}/memory/{g}/memory.limit_in_bytes") == str(64 * MiB)
  assert _read(f"{r}/pids/{g}/pids.max") == "7"
  assert (_read(f"{r}/cpu/{g}/cpu.cfs_quota_us"), _read(f"{r}/cpu/{g}/cpu.cfs_period_us")) == ("50000", "100000")
  assert cg.procs_files() == sorted(f"{p}/{g}/cgroup.procs" for p in parents.values())
  assert cg.cpu_seconds() == 2.5


def test_v2_files(tmp_path):
  r = str(tmp_path)
  with open(f"{r}/cgroup.controllers", "w") as f:
    f.write("cpuset cpu io memory pids\n")
  for d in (r, f"{r}/composer_sandboxes"):
    _mkdirs(d)
    with open(f"{d}/cgroup.subtree_control", "w") as f:
      f.write("")
  _mkdirs(f"{r}/composer_sandboxes/g")
  with open(f"{r}/composer_sandboxes/g/cpu.stat", "w") as f:
    f.write("usage_usec 1500000\nuser_usec 1000000\n")
  cg = SandboxCgroup("g", LIM, {c: r for c in ("memory", "pids", "cpu", "cpuacct")})
  g = f"{r}/composer_sandboxes/g"
  # Controllers are enabled for children at both levels; one directory carries every limit.
  assert _read(f"{r}/cgroup.subtree_control") == "+cpu +memory +pids"
  assert _read(f"{r}/composer_sandboxes/cgroup.subtree_control") == "+cpu +memory +pids"
  assert _read(f"{g}/memory.max") == str(64 * MiB)
  assert _read(f"{g}/pids.max") == "7"
  assert _read(f"{g}/cpu.max") == "50000 100000"
  assert cg.procs_files() == [f"{g}/cgroup.procs"]
  assert cg.cpu_seconds() == 1.5


def _names(triples):
  return {t[0] for t in triples}


def test_rlimit_backstops_depend_on_cgroups():
  full = rlimits_for(Limits(cpu_seconds=2.2), {"memory", "pids", "cpu", "cpuacct"})
  assert (resource.RLIMIT_CPU, 4, 5) in full  # ceil(2.2) + 1 s soft, +1 s hard (SIGKILL)
  assert resource.RLIMIT_AS not in _names(full) and resource.RLIMIT_NPROC not in _names(full)
  bare = rlimits_for(Limits(), set())
  assert {resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_FSIZE} <= _names(bare)


@ROOT_ONLY
def test_real_groups_get_the_limits(tmp_path):
  with BwrapBackend() as be, be.create(str(tmp_path)) as sb:
    assert sb.cgroup is not None, "this machine has cgroup v1 memory/pids/cpu; they should be used"
    lim = sb.config.limits
    d = sb.cgroup.dirs
    mem = _read(os.path.join(d["memory"], "memory.max" if sb.cgroup.v2["memory"] else "memory.limit_in_bytes"))
    assert int(mem) == lim.memory_bytes
    assert int(_read(os.path.join(d["pids"], "pids.max"))) == lim.max_pids
    r = sb.run("cat /proc/self/cgroup")  # the command runs inside them (the cgroup namespace hides the path)
    assert r.ok and r.stdout_text.strip()
    assert sb.cgroup.cpu_seconds() > 0  # the run was accounted


@ROOT_ONLY
def test_cpus_bandwidth_throttles(tmp_path):
  cfg = SandboxConfig(limits=Limits(cpus=0.2))
  with BwrapBackend(config=cfg) as be, be.create(str(tmp_path)) as sb:
    d = sb.cgroup.dirs["cpu"]
    quota = _read(os.path.join(d, "cpu.max")).split()[0] if sb.cgroup.v2["cpu"] else _read(
      os.path.join(d, "cpu.cfs_quota_us")).strip()
    assert quota == "20000"
    r = sb.run(["timeout", "1.5", "python3", "-c", "while True: pass"], timeout=30)
    used = sb.cgroup.run_cpu_seconds()
    # At most 0.2 CPU-seconds per wall second (+ one 100 ms CFS period of slack and python's start-up).
    assert r.exit_code == 124 and used <= 0.2 * r.wall_s + 0.15, (used, r.wall_s)
