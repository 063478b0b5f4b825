"""composer_jax/train/corpus.py: filters, dedupe, a hash-defined split, caps, git work trees, clear errors."""

import dataclasses
import hashlib
import os
import subprocess

import pytest

from composer_jax.train import corpus as corpus_lib


def _write(root, rel, content):
  path = os.path.join(root, rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(content.encode() if isinstance(content, str) else content)
  return path


def _code(i):
  return f"def function_{i}(x):\n    return x * {i} + {i * i}\n" * 3


def _make_tree(root, n=40):
  for i in range(n):
    _write(root, f"pkg{i % 3}/mod_{i}.py", _code(i))
  return root


def test_filters_and_dedupe(tmp_path):
  root = str(tmp_path)
  _write(root, "a.py", _code(1))
  _write(root, "copy_of_a.py", _code(1))  # Exact duplicate: dropped.
  _write(root, "b.rs", "fn main() { println!(\"hi\"); }\n" * 4)
  _write(root, "tiny.py", "x=1\n")  # Below min_file_bytes.
  _write(root, "big.py", "x = 1\n" * 100)  # Above max_file_bytes.
  _write(root, "latin1.py", "s = 'caf\xe9'\n".encode("latin-1") * 10)
  _write(root, "blob.py", b"\0\1\2" * 40)
  _write(root, "notes.xyz", _code(2))  # Unknown extension.
  _write(root, "__pycache__/c.py", _code(3))  # Excluded directory.
  _write(root, "Makefile", "all:\n\techo build everything here\n" * 3)
  cfg = corpus_lib.CorpusConfig(paths=(root,), languages=None, min_file_bytes=16, max_file_bytes=500,
                                heldout_fraction=0.0)
  corpus = corpus_lib.load_corpus(cfg)
  got = {os.path.basename(d.path): d.language for d in corpus.train}
  assert got == {"b.rs": "rust", "Makefile": "make", ("a.py" if "a.py" in got else "copy_of_a.py"): "python"}
  assert corpus.heldout == ()
  s = corpus.stats
  assert (s["duplicate"], s["too_small"], s["too_large"], s["not_utf8"], s["binary"], s["wrong_language"]) == (
    1, 1, 1, 1, 1, 1)
  assert s["files_seen"] == 9  # __pycache__ is never entered.
  for d in corpus.train:
    assert d.sha256 == hashlib.sha256(d.text.encode()).hexdigest()
  python_only = corpus_lib.load_corpus(dataclasses.replace(cfg, languages=("python",)))
  assert [d.language for d in python_only.train] == ["python"]


def test_split_is_by_content_hash_and_stable_under_renaming(tmp_path):
  a = _make_tree(str(tmp_path / "a"))
  b = str(tmp_path / "b")
  for i in reversed(range(40)):  # Same contents, other names, other creation order.
    _write(b, f"renamed/x{39 - i}/file_{i * 7}.py", _code(i))
  cfg = corpus_lib.CorpusConfig(paths=(a,), heldout_fraction=0.25, min_heldout_files=0)
  ca = corpus_lib.load_corpus(cfg)
  cb = corpus_lib.load_corpus(dataclasses.replace(cfg, paths=(b,)))
  texts = lambda docs: sorted(d.text for d in docs)
  assert texts(ca.heldout) == texts(cb.heldout) and texts(ca.train) == texts(cb.train)
  # Independent reference: held out iff the first 64 bits of SHA-256 / 2**64 < fraction.
  want = sorted(_code(i) for i in range(40) if int(hashlib.sha256(_code(i).encode()).hexdigest()[:16], 16) < 2**62)
  assert texts(ca.heldout) == want and 0 < len(want) < 40
  assert ca == corpus_lib.load_corpus(cfg)  # Deterministic.


def test_min_heldout_files_takes_smallest_hashes(tmp_path):
  root = _make_tree(str(tmp_path), n=5)
  corpus = corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(root,), heldout_fraction=1e-9, min_heldout_files=2))
  smallest = sorted(hashlib.sha256(_code(i).encode()).hexdigest() for i in range(5))[:2]
  assert sorted(d.sha256 for d in corpus.heldout) == smallest
  assert len(corpus.train) == 3


def test_caps(tmp_path):
  root = _make_tree(str(tmp_path))
  capped = corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(root,), max_files=10))
  assert len(capped.train) + len(capped.heldout) == 10
  assert capped.stats["over_file_cap"] == 30
  assert capped == corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(root,), max_files=10))
  size = len(_code(5).encode())  # All files are about this size.
  by_bytes = corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(root,), max_total_bytes=6 * size))
  total = by_bytes.stats["train_bytes"] + by_bytes.stats["heldout_bytes"]
  assert 4 * size <= total <= 6 * size
  # The same file is on the same side of the split whatever the cap.
  full = corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(root,), min_heldout_files=0))
  capped0 = corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(root,), max_files=20, min_heldout_files=0))
  assert {d.sha256 for d in capped0.heldout} <= {d.sha256 for d in full.heldout}
  assert {d.sha256 for d in capped0.train} <= {d.sha256 for d in full.train}


def test_git_repo_uses_tracked_files(tmp_path):
  root = str(tmp_path / "repo")
  _write(root, "tracked.py", _code(1))
  _write(root, "sub/also_tracked.py", _code(2))
  _write(root, ".gitignore", "ignored.py\n")
  _write(root, "ignored.py", _code(3))
  git = lambda *args: subprocess.run(["git", "-C", root, "-c", "user.email=t@t", "-c", "user.name=t", *args],
                                     check=True, capture_output=True)
  git("init", "-q")
  git("add", "tracked.py", "sub/also_tracked.py", ".gitignore")
  git("commit", "-qm", "init")
  _write(root, "untracked.py", _code(4))
  corpus = corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(root,), heldout_fraction=0.0))
  assert sorted(os.path.relpath(d.path, root) for d in corpus.train) == ["sub/also_tracked.py", "tracked.py"]


def test_several_roots_and_single_file(tmp_path):
  a = _write(str(tmp_path), "one/a.py", _code(1))
  b = _make_tree(str(tmp_path / "two"), n=3)
  corpus = corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(a, b), heldout_fraction=0.0))
  # _code(1) appears in both roots: kept once.
  assert sorted(d.text for d in corpus.train) == sorted({_code(1), _code(0), _code(2)})
  assert corpus.stats["duplicate"] == 1


def test_errors_name_the_problem(tmp_path):
  missing = str(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="nope"):
    corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(missing,)))
  empty = str(tmp_path / "empty")
  _write(empty, "readme.xyz", "not code")
  with pytest.raises(ValueError, match=r"corpus is empty.*empty.*languages=\('python',\).*wrong_language': 1"):
    corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(empty,)))
  one = str(tmp_path / "one")
  _write(one, "a.py", _code(1))
  with pytest.raises(ValueError, match="too few"):
    corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(one,)))
  with pytest.raises(ValueError, match="unknown languages"):
    corpus_lib.CorpusConfig(languages=("klingon",))
  with pytest.raises(TypeError, match="tuple of paths"):
    corpus_lib.CorpusConfig(paths="/tmp")


def test_default_corpus_is_the_stdlib():
  corpus = corpus_lib.load_corpus(corpus_lib.CorpusConfig(max_total_bytes=300_000))
  paths = [d.path for d in corpus.train + corpus.heldout]
  assert all(p.startswith(corpus_lib.default_paths()[0]) and p.endswith((".py", ".pyi")) for p in paths)
  assert not any("site-packages" in p for p in paths)
  assert 200_000 < corpus.stats["train_bytes"] + corpus.stats["heldout_bytes"] <= 300_000


def test_export_is_what_the_contamination_guard_reads(tmp_path):
  from rollout.evaluation import contamination
  corpus = corpus_lib.load_corpus(corpus_lib.CorpusConfig(paths=(_make_tree(str(tmp_path / "src")),),
                                                          heldout_fraction=0.2))
  path = str(tmp_path / "out" / "train.jsonl")
  assert corpus_lib.export_corpus(corpus, path) == len(corpus.train)
  assert list(contamination.read_corpus(path)) == [d.text for d in corpus.train]
  both = corpus_lib.export_corpus(corpus, str(tmp_path / "all.jsonl"), splits=("train", "heldout"))
  assert both == len(corpus.train) + len(corpus.heldout)
  with pytest.raises(ValueError, match="unknown corpus splits"):
    corpus_lib.export_corpus(corpus, path, splits=("test",))
