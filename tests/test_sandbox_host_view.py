"""What other host users can do with a fork's files, and what the host leaks into a fork.

Found by an attack run through the public API (each test failed before its fix): a file made setuid inside a
sandbox ran as the sandbox uid for any local user through the host's merged mount (listed in everybody's
/proc/self/mountinfo), so that user could write into the snapshot every later fork starts from, and the setuid
bit survived `snapshot()`; the host's own name was in the sandbox's /etc/hosts.
"""

import os
import shutil
import socket
import stat
import subprocess
import tempfile

import pytest

from tests.sandbox_testlib import ROOT_ONLY, bwrap_backend

pytestmark = ROOT_ONLY

SANDBOX_GID = 60000  # the backend's default host_gid
OTHER_UID = 60001  # a local user that is not the sandbox


@pytest.fixture(scope="module")
def backend():
  with bwrap_backend("sbx_hostview_") as be:
    yield be


@pytest.fixture
def drop_box():
  """A directory every local user may write to: who created a file in it tells which uid a program ran as."""
  d = tempfile.mkdtemp(prefix="sbx_drop_", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
  os.chmod(d, 0o777)
  yield d
  shutil.rmtree(d)


def _as_user(uid: int, gid: int, argv: list[str]) -> subprocess.CompletedProcess:
  # Through `sh`: setpriv resolves the program's path before its capabilities are gone (they go at that exec),
  # so a path only root can walk would still work for the program it starts itself.
  return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", "sh", "-c",
                         '"$0" "$@"'] + argv, capture_output=True, text=True, timeout=30)


SETUID_TOUCH = "cp /usr/bin/touch t && chmod 4755 t && stat -c %a t"


def test_setuid_file_in_a_fork_is_unreachable_for_other_host_users(backend, tmp_path, drop_box):
  with backend.create(str(tmp_path)) as sb:
    assert sb.run(SETUID_TOUCH).stdout_text == "4755\n"  # chmod works inside; the bit is what must not act
    made = os.path.join(drop_box, "made")
    r = _as_user(OTHER_UID, OTHER_UID, [os.path.join(sb.merged, "t"), made])
    assert not os.path.exists(made), f"ran as uid {os.stat(made).st_uid}: {r}"
    assert "Permission denied" in r.stderr, r
    # Nor can that user look into the store at all (the mounts are listed in its /proc/self/mountinfo).
    assert _as_user(OTHER_UID, OTHER_UID, ["ls", backend.store.path]).returncode != 0


def test_setuid_bit_does_not_act_through_the_hosts_merged_mount(backend, tmp_path, drop_box):
  """Even for a user who reaches the mount (one in the sandbox's group), the overlay is `nosuid`."""
  with backend.create(str(tmp_path)) as sb:
    assert sb.run(SETUID_TOUCH).ok
    made = os.path.join(drop_box, "made")
    r = _as_user(OTHER_UID, SANDBOX_GID, [os.path.join(sb.merged, "t"), made])
    assert r.returncode == 0, r
    assert os.stat(made).st_uid == OTHER_UID  # its own uid, not the sandbox's 60000


def _modes(root: str) -> dict[str, int]:
  return {name: stat.S_IMODE(os.lstat(os.path.join(root, name)).st_mode) for name in sorted(os.listdir(root))}


def test_snapshot_and_import_drop_setuid_and_setgid_bits(backend, tmp_path):
  base = tmp_path / "base"
  base.mkdir()
  shutil.copy("/usr/bin/true", base / "imported")
  os.chmod(base / "imported", 0o6755)
  snap0 = backend.import_dir(str(base))
  assert _modes(snap0.layers[0])["imported"] == 0o755
  with backend.fork(snap0) as sb:
    assert sb.run("cp /usr/bin/true u && chmod 4755 u && cp u g && chmod 2755 g && cp u plain").ok
    snap = sb.snapshot()
    assert sb.run("stat -c %a u").stdout_text == "755\n"  # the fork goes on from its snapshot
  assert _modes(snap.layers[0]) == {"g": 0o755, "plain": 0o755, "u": 0o755}
  with backend.fork(snap) as sb2:
    assert sb2.run("stat -c %a u g imported").stdout_text.split() == ["755"] * 3
  backend.delete_snapshot(snap)
  backend.delete_snapshot(snap0)


def test_etc_hosts_names_only_the_sandbox(backend, tmp_path):
  with backend.create(str(tmp_path)) as sb:
    hosts = sb.run("cat /etc/hosts").stdout_text
    names = {n for line in hosts.splitlines() if line.split() and not line.startswith("#") for n in line.split()[1:]}
    assert names <= {"localhost", "sandbox", "ip6-localhost", "ip6-loopback"}, hosts
    assert socket.gethostname() not in names
    r = sb.run(["python3", "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"])
    assert r.stdout_text.startswith("127."), r  # the sandbox's own name resolves (to loopback)
