"""Snapshot/fork semantics on overlayfs: independence of forks, snapshots of forks, layer chains and flattening."""


import pytest

from sandboxes import SandboxError
from tests.sandbox_testlib import ROOT_ONLY, backend_fixture

pytestmark = ROOT_ONLY

BASE = {"keep.txt": "keep\n", "del.txt": "del\n", "mv.txt": "mv\n", "d/sub.txt": "sub\n", "d/e/deep.txt": "deep\n"}


def tree(sb) -> dict[str, str]:
  """Every regular file in the workspace as seen from *inside* (path -> content)."""
  r = sb.run("find . -type f | sort | while read f; do printf '%s\\t%s\\0' \"${f#./}\" \"$(cat \"$f\")\"; done")
  assert r.ok, r.stderr_text
  return dict(item.split("\t", 1) for item in r.stdout_text.split("\0") if item) if r.stdout else {}


def expect(files: dict[str, str]) -> dict[str, str]:
  return {k: v.rstrip("\n") for k, v in files.items()}  # $(cat) strips the trailing newline


backend = backend_fixture(max_layers=3)


@pytest.fixture(scope="module")
def snap(backend, tmp_path_factory):
  base = tmp_path_factory.mktemp("repo")
  for rel, text in BASE.items():
    (base / rel).parent.mkdir(parents=True, exist_ok=True)
    (base / rel).write_text(text)
  return backend.import_dir(str(base))


def test_import_copies_base(backend, snap):
  with backend.fork(snap) as sb:
    assert tree(sb) == expect(BASE)
    assert sb.list_dir() == ["d", "del.txt", "keep.txt", "mv.txt"]
    assert sb.run("stat -c %u keep.txt; touch keep.txt && echo edited").stdout == b"1000\nedited\n"


def test_forks_are_independent(backend, snap):
  n = 4
  forks = [backend.fork(snap) for _ in range(n)]
  try:
    edits = [
      "echo changed > keep.txt",
      "rm del.txt && rm -r d",
      "mv mv.txt moved.txt && mv d d2",
      "echo new > d/e/new.txt && chmod 600 d/sub.txt",
    ]
    for sb, cmd in zip(forks, edits, strict=True):
      assert sb.run(cmd).ok
    want = [dict(BASE) for _ in range(n)]
    want[0]["keep.txt"] = "changed\n"
    want[1] = {k: v for k, v in BASE.items() if k not in ("del.txt", "d/sub.txt", "d/e/deep.txt")}
    want[2] = {("moved.txt" if k == "mv.txt" else k.replace("d/", "d2/", 1)): v for k, v in BASE.items()}
    want[3]["d/e/new.txt"] = "new\n"
    for sb, w in zip(forks, want, strict=True):
      assert tree(sb) == expect(w)
    with backend.fork(snap) as fresh:  # the snapshot itself is untouched
      assert tree(fresh) == expect(BASE)
  finally:
    for sb in forks:
      sb.close()


def test_snapshot_of_fork_sees_changes_and_stays_frozen(backend, snap):
  with backend.fork(snap) as sb:
    assert sb.run("echo v2 > keep.txt && rm del.txt && mv d dd && mkdir -p empty/dir").ok
    sb.write_file("host_written.txt", "from host")
    s2 = sb.snapshot()
    want = {"keep.txt": "v2", "mv.txt": "mv", "dd/sub.txt": "sub", "dd/e/deep.txt": "deep",
            "host_written.txt": "from host"}
    assert tree(sb) == want
    assert sb.run("echo v3 > keep.txt && rm -r dd").ok  # keeps working after the snapshot...
    with backend.fork(s2) as f2:
      assert tree(f2) == want  # ...without changing the snapshot
      assert f2.run("test -d empty/dir && test ! -e del.txt").ok  # dirs and deletions (whiteouts) carry over
      assert f2.run("echo again > del.txt && cat del.txt").stdout == b"again\n"
    with backend.fork(snap) as f0:
      assert tree(f0) == expect(BASE)


def test_snapshot_chain_is_flattened_and_stays_equal(backend, snap):
  # max_layers=3: a chain of snapshots must be flattened; the content must equal the plain reference dict.
  want = expect(BASE)
  with backend.fork(snap) as sb:
    s = snap
    for i in range(6):
      cmd = f"echo {i} > f{i}.txt" + (f" && rm f{i - 2}.txt" if i >= 2 else "") + (" && rm -r d" if i == 3 else "")
      assert sb.run(cmd).ok
      want[f"f{i}.txt"] = str(i)
      want.pop(f"f{i - 2}.txt", None)
      if i == 3:
        want = {k: v for k, v in want.items() if not k.startswith("d/")}
      s = sb.snapshot()
      assert len(s.layers) <= 3
      with backend.fork(s) as f:
        assert tree(f) == want
  assert len(snap.layers) == 1


def test_unchanged_snapshot_reuses_layers(backend, snap):
  with backend.fork(snap) as sb:
    assert sb.snapshot().layers == snap.layers


def test_host_file_ops_round_trip(backend, snap):
  with backend.fork(snap) as sb:
    sb.write_file("/workspace/new/dir/x.bin", bytes(range(256)))
    r = sb.run("od -An -tu1 new/dir/x.bin | wc -w; echo more >> new/dir/x.bin; stat -c %u new/dir")
    assert r.stdout.split() == [b"256", b"1000"]  # host-written files belong to the sandbox user
    assert sb.read_file("new/dir/x.bin") == bytes(range(256)) + b"more\n"
    assert sb.read_file("new/dir/x.bin", max_bytes=3) == b"\x00\x01\x02"
    assert sb.list_dir("new/dir") == ["x.bin"]
    sb.remove("new")
    assert not sb.exists("new") and sb.run("test -e new").exit_code == 1


def test_delete_snapshot_frees_layers_only_when_unused(backend, tmp_path):
  (tmp_path / "a").write_text("a")
  n0 = backend.live_layers
  base = backend.import_dir(str(tmp_path))
  sb = backend.fork(base)
  assert sb.run("echo b > b").ok
  s2 = sb.snapshot()
  assert backend.live_layers == n0 + 2
  backend.delete_snapshot(base)
  with pytest.raises(SandboxError, match="unknown snapshot"):
    backend.fork(base)
  with pytest.raises(SandboxError, match="already deleted"):
    backend.delete_snapshot(base)
  assert backend.live_layers == n0 + 2  # s2 (and the live fork) stack on the base layer
  backend.delete_snapshot(s2)
  assert backend.live_layers == n0 + 2  # the fork still mounts both
  assert sb.run("cat a b").stdout == b"ab\n"
  sb.close()
  assert backend.live_layers == n0  # last user gone: both layers deleted
