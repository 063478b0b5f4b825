"""Resource limits and kills with real processes: fork bomb, memory hog, disk filler, CPU burner, escapees."""

import os

import pytest

from sandboxes import BwrapBackend, Limits, SandboxConfig, limits
from tests.sandbox_testlib import ROOT_ONLY, host_procs_with

pytestmark = ROOT_ONLY

MiB = 1 << 20
LIMITS = Limits(memory_bytes=64 * MiB, max_pids=32, file_size_bytes=1 * MiB, cpu_seconds=1.0, disk_bytes=20 * MiB)


# Both ways of putting bwrap into its cgroups/rlimits/uid must enforce the same limits.
@pytest.fixture(scope="module", params=["exec", "preexec"])
def backend(request, tmp_path_factory):
  base = tmp_path_factory.mktemp("base")
  (base / "a.txt").write_text("a")
  be = BwrapBackend(config=SandboxConfig(limits=LIMITS), launcher=request.param)
  if request.param == "exec":
    assert limits.launcher_argv([], []) is not None, "util-linux prlimit/setpriv are expected on this machine"
  be.test_snapshot = be.import_dir(str(base))
  yield be
  be.close()


@pytest.fixture
def sb(backend):
  with backend.fork(backend.test_snapshot) as s:
    yield s




def test_fork_bomb_is_bounded_by_pids_limit(sb):
  # bash retries a failed fork with back-off, so the bomb may run until the timeout; either way it is reported and
  # reaped.
  r = sb.run("bomb() { bomb | bomb & }; bomb; sleep 1", timeout=3)
  assert r.limit_hit == "pids"
  assert r.wall_s < 10  # generous: other jobs may load the machine
  assert sb.cgroup.pids() == set()  # nothing of the bomb is left
  assert sb.run("echo ok").stdout == b"ok\n"  # and the sandbox is usable again


def test_memory_hog_is_oom_killed(sb):
  r = sb.run(["python3", "-c", "x = bytearray(256 << 20); print('allocated')"], timeout=20)
  assert r.limit_hit == "memory"
  assert r.exit_code == 128 + 9  # SIGKILL from the OOM killer
  assert b"allocated" not in r.stdout


def test_memory_under_limit_is_fine(sb):
  r = sb.run(["python3", "-c", "x = bytearray(8 << 20); print(len(x))"], timeout=20)
  assert r.ok and r.stdout == b"8388608\n"


@pytest.mark.parametrize("cmd", ["head -c 5000000 /dev/zero > big; echo done", "dd if=/dev/zero of=big bs=1M count=5"])
def test_disk_filler_stops_at_file_size_limit(sb, cmd):
  r = sb.run(cmd, timeout=20)
  assert r.limit_hit == "file_size", r
  assert os.path.getsize(os.path.join(sb.merged, "big")) == 1 * MiB


def test_many_small_files_are_stopped_at_disk_limit(sb):
  # Each file is under file_size_bytes; only the total (20 MiB) stops this loop: the kernel refuses the write.
  r = sb.run("for i in $(seq 60); do head -c 900000 /dev/zero > f$i || { echo stopped at $i; break; }; done",
             timeout=30)
  assert r.limit_hit == "disk" and "No space left" in r.stderr_text, r
  n = int(r.stdout_text.split()[-1])
  assert 20 <= n <= 24  # 20 MiB / 900 kB, give or take a file
  used = sum(os.path.getsize(os.path.join(sb.merged, f)) for f in sb.list_dir() if f.startswith("f"))
  assert used <= 20 * MiB
  sb.run("rm -f f*")


def test_cpu_burner_is_stopped_at_cpu_time_limit(sb):
  # 1 s of CPU; the wall time depends on how loaded the machine is, so the timeout is far away.
  r = sb.run(["python3", "-c", "while True: pass"], timeout=120)
  assert r.limit_hit == "cpu_time"
  assert not r.timed_out and r.exit_code is None


def test_timeout_kills_sigterm_ignoring_command(sb):
  # The timeout leaves room for the sandbox to start and print: at load ~10 on 2 cores a 1 s timeout has killed
  # the command before its `echo` ran.
  r = sb.run("trap '' TERM INT HUP; echo started; sleep 100", timeout=3.0)
  assert r.timed_out and r.exit_code is None and r.limit_hit is None
  assert r.stdout == b"started\n"  # output before the kill is kept
  assert 3.0 <= r.wall_s < 8.0      # killed soon after the timeout, not after the sleep


@pytest.mark.parametrize("how", ["setsid", "nohup", "disown"])
def test_background_processes_die_with_the_command(sb, how):
  marker = f"7{os.getpid()}{len(how)}3.25"
  launch = {"setsid": f"setsid sleep {marker} &", "nohup": f"nohup sleep {marker} >/dev/null 2>&1 &",
            "disown": f"sleep {marker} & disown"}[how]
  r = sb.run(launch + "\n echo launched", timeout=10)
  assert r.ok and r.stdout == b"launched\n"
  assert r.wall_s < 5  # the escapee does not hold the output pipes open
  assert host_procs_with(f"sleep {marker}") == []
  assert sb.cgroup.pids() == set()


def test_parent_survives_everything(backend):
  assert os.getpid() == os.getpid() and backend.store.path  # got here: none of the above killed the test process
