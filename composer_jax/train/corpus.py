"""A source-code corpus from local directories or git repositories, filtered, deduplicated and split.

`load_corpus(CorpusConfig(...))` walks each path (for a git work tree, the files git tracks), keeps files whose
language is known from the extension (`LANGUAGES`, `FILENAMES`) and whose size is within bounds, decodes them as
UTF-8 (others are skipped and counted), removes exact duplicates by SHA-256 of the content and splits the rest into
train / held-out by that same hash, so the split does not change when files are renamed, moved or listed in another
order. With no paths the corpus is the running Python's standard library, present offline on every machine.

Caps (`max_files`, `max_total_bytes`) take files in the order of a hash of their path relative to the root: a
spread-out, reproducible sample (not the alphabetically first files), chosen before any file is read, so a capped
corpus loads in well under a second. Everything the filters dropped is counted in `Corpus.stats`; an empty result is
an error naming the paths, the filters and those counts.

`export_corpus` writes a split as JSONL, the format the evaluation's contamination guard reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sysconfig

LANGUAGES = {
  ".py": "python", ".pyi": "python", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp", ".hpp": "cpp",
  ".hh": "cpp", ".cu": "cuda", ".rs": "rust", ".go": "go", ".java": "java", ".kt": "kotlin", ".scala": "scala",
  ".js": "javascript", ".mjs": "javascript", ".jsx": "javascript", ".ts": "typescript", ".tsx": "typescript",
  ".rb": "ruby", ".php": "php", ".cs": "csharp", ".swift": "swift", ".lua": "lua", ".jl": "julia", ".r": "r",
  ".hs": "haskell", ".ml": "ocaml", ".sh": "shell", ".bash": "shell", ".sql": "sql", ".html": "html", ".css": "css",
  ".md": "markdown", ".rst": "rst", ".txt": "text", ".json": "json", ".toml": "toml", ".yaml": "yaml",
  ".yml": "yaml", ".cfg": "ini", ".ini": "ini",
}
FILENAMES = {"Makefile": "make", "Dockerfile": "dockerfile", "CMakeLists.txt": "cmake"}
DEFAULT_EXCLUDE_DIRS = ("__pycache__", ".git", "site-packages", "dist-packages", "node_modules", ".venv", "venv",
                        ".tox", ".mypy_cache", ".pytest_cache")


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
  """Which files make the corpus.

  Attributes:
    paths: directories, git work trees or single files; empty means the running Python's standard library.
    languages: keep only these language names (values of `LANGUAGES` / `FILENAMES`); None keeps every known one.
    min_file_bytes / max_file_bytes: size bounds per file (tiny files are mostly empty `__init__.py`; huge ones are
      mostly generated data).
    max_files / max_total_bytes: caps on what is read (None = no cap); the colab config uses a few MB.
    heldout_fraction: share of unique files (by content hash) held out for evaluation.
    min_heldout_files: hold out at least this many (the smallest hashes) so a tiny corpus still has an eval set.
    exclude_dirs: directory names never entered.
  """
  paths: tuple[str, ...] = ()
  languages: tuple[str, ...] | None = ("python",)
  min_file_bytes: int = 64
  max_file_bytes: int = 256 * 1024
  max_files: int | None = None
  max_total_bytes: int | None = None
  heldout_fraction: float = 0.02
  min_heldout_files: int = 1
  exclude_dirs: tuple[str, ...] = DEFAULT_EXCLUDE_DIRS

  def __post_init__(self):
    if isinstance(self.paths, str):
      raise TypeError(f"paths must be a tuple of paths, got the string {self.paths!r}")
    if not 0.0 <= self.heldout_fraction < 1.0:
      raise ValueError(f"heldout_fraction={self.heldout_fraction} must be in [0, 1)")
    known = set(LANGUAGES.values()) | set(FILENAMES.values())
    unknown = sorted(set(self.languages or ()) - known)
    if unknown:
      raise ValueError(f"unknown languages {unknown}; known: {sorted(known)}")


@dataclasses.dataclass(frozen=True)
class Document:
  """One source file."""
  path: str  # As found (root joined with the relative path).
  language: str
  text: str
  sha256: str  # Of the UTF-8 content; defines dedupe and the split.


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Train and held-out documents (each sorted by path) and counts of what the filters dropped."""
  train: tuple[Document, ...]
  heldout: tuple[Document, ...]
  stats: dict[str, int]


def default_paths() -> tuple[str, ...]:
  """The running Python's standard library source directory."""
  return (sysconfig.get_paths()["stdlib"],)


def language_of(path: str) -> str | None:
  """The language of a file from its name, or None if unknown."""
  name = os.path.basename(path)
  return FILENAMES.get(name) or LANGUAGES.get(os.path.splitext(name)[1].lower())


def _list_root(root: str, exclude_dirs: tuple[str, ...]) -> list[str]:
  """Relative paths of the files under `root` (git-tracked files for a git work tree)."""
  if os.path.isfile(root):
    return [""]
  if not os.path.isdir(root):
    raise FileNotFoundError(f"corpus path {root!r} does not exist")
  if not os.access(root, os.R_OK | os.X_OK):
    raise PermissionError(f"corpus path {root!r} is not readable")
  if os.path.exists(os.path.join(root, ".git")):
    try:
      out = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, check=True).stdout
    except FileNotFoundError as e:
      raise RuntimeError(f"{root!r} is a git work tree but the git executable was not found") from e
    except subprocess.CalledProcessError as e:
      raise RuntimeError(f"git ls-files failed in {root!r}: {e.stderr.decode(errors='replace').strip()}") from e
    rels = [p for p in out.decode("utf-8", errors="surrogateescape").split("\0") if p]
    return [p for p in rels if not set(p.split("/")[:-1]) & set(exclude_dirs)]
  rels = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in exclude_dirs)
    rel_dir = os.path.relpath(dirpath, root)
    rels += [os.path.normpath(os.path.join(rel_dir, f)) for f in filenames]
  return rels


def _hash_fraction(hex_digest: str) -> float:
  """A uniform number in [0, 1) from a hex digest."""
  return int(hex_digest[:16], 16) / 2.0**64


def _candidates(paths: tuple[str, ...], cfg: CorpusConfig, stats: dict[str, int]) -> list[tuple[str, str, str, int]]:
  """(order key, path, language, size) of the files that pass the name and size filters, in cap order."""
  out = []
  for root in paths:
    for rel in _list_root(root, cfg.exclude_dirs):
      path = os.path.join(root, rel) if rel else root
      stats["files_seen"] += 1
      language = language_of(path)
      if language is None or (cfg.languages is not None and language not in cfg.languages):
        stats["wrong_language"] += 1
        continue
      if os.path.islink(path) or not os.path.isfile(path):
        stats["symlink"] += 1  # Never follow links out of the corpus; gitlinks (submodules) are not files.
        continue
      try:
        size = os.stat(path).st_size
      except OSError:
        stats["unreadable"] += 1
        continue
      if size < cfg.min_file_bytes:
        stats["too_small"] += 1
      elif size > cfg.max_file_bytes:
        stats["too_large"] += 1
      else:
        key = hashlib.sha256((rel or os.path.basename(root)).encode("utf-8", "surrogateescape")).hexdigest()
        out.append((key, path, language, size))
  return sorted(out)


def _read_unique(candidates, cfg: CorpusConfig, stats: dict[str, int]) -> list[Document]:
  """Reads candidates within the caps, dropping binary, non-UTF-8 and duplicate files."""
  docs, seen, total = [], set(), 0
  for _, path, language, size in candidates:
    if cfg.max_files is not None and len(docs) >= cfg.max_files:
      stats["over_file_cap"] += 1
      continue
    if cfg.max_total_bytes is not None and total + size > cfg.max_total_bytes:
      stats["over_byte_cap"] += 1
      continue
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError:
      stats["unreadable"] += 1
      continue
    if b"\0" in data:
      stats["binary"] += 1
      continue
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError:
      stats["not_utf8"] += 1
      continue
    digest = hashlib.sha256(data).hexdigest()
    if digest in seen:
      stats["duplicate"] += 1
      continue
    seen.add(digest)
    docs.append(Document(path, language, text, digest))
    total += len(data)
  return docs


def _split(docs: list[Document], cfg: CorpusConfig, paths: tuple[str, ...]) -> tuple[tuple[Document, ...], ...]:
  """(train, held-out), each sorted by path; held-out = the documents with the smallest content hashes."""
  by_hash = sorted(docs, key=lambda d: d.sha256)
  n_heldout = sum(_hash_fraction(d.sha256) < cfg.heldout_fraction for d in by_hash)  # A prefix of by_hash.
  if cfg.heldout_fraction > 0:
    n_heldout = max(n_heldout, cfg.min_heldout_files)
  if n_heldout >= len(docs):
    raise ValueError(f"only {len(docs)} unique files under {list(paths)}: too few for {n_heldout} held-out files "
                     f"and at least one training file (heldout_fraction={cfg.heldout_fraction}, "
                     f"min_heldout_files={cfg.min_heldout_files})")
  return (tuple(sorted(by_hash[n_heldout:], key=lambda d: d.path)),
          tuple(sorted(by_hash[:n_heldout], key=lambda d: d.path)))


def load_corpus(cfg: CorpusConfig = CorpusConfig()) -> Corpus:
  """Lists, filters, reads, deduplicates and splits the corpus.

  Args:
    cfg: paths and filters.

  Returns:
    The corpus; `stats` counts files seen and dropped per reason, and the bytes in each split.

  Raises:
    FileNotFoundError / PermissionError: a path is missing or unreadable.
    ValueError: no file passed the filters (the message names paths, filters and the counts).
  """
  paths = tuple(cfg.paths) or default_paths()
  stats = dict.fromkeys(["files_seen", "wrong_language", "too_small", "too_large", "symlink", "unreadable",
                         "not_utf8", "binary", "duplicate", "over_file_cap", "over_byte_cap"], 0)
  docs = _read_unique(_candidates(paths, cfg, stats), cfg, stats)
  if not docs:
    raise ValueError(
      f"corpus is empty: no file under {list(paths)} passed the filters (languages={cfg.languages}, "
      f"min_file_bytes={cfg.min_file_bytes}, max_file_bytes={cfg.max_file_bytes}, max_files={cfg.max_files}, "
      f"max_total_bytes={cfg.max_total_bytes}, exclude_dirs={cfg.exclude_dirs}); counts: {stats}")
  train, heldout = _split(docs, cfg, paths)
  stats.update(train_files=len(train), heldout_files=len(heldout),
               train_bytes=sum(len(d.text.encode()) for d in train),
               heldout_bytes=sum(len(d.text.encode()) for d in heldout))
  return Corpus(train, heldout, stats)


def export_corpus(corpus: Corpus, path: str, splits: tuple[str, ...] = ("train",)) -> int:
  """Writes the documents of `splits` as JSONL ({"text", "path", "sha256"} per line) and returns how many.

  Point the evaluation's contamination guard at exactly what a model was trained on:
  `export_corpus(load_corpus(cfg), "runs/x/train_corpus.jsonl")`, then `eval.py:...,corpus=runs/x/train_corpus.jsonl`.
  """
  bad = [s for s in splits if s not in ("train", "heldout")]
  if bad:
    raise ValueError(f"unknown corpus splits {bad}; valid: ('train', 'heldout')")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  n = 0
  with open(path, "w", encoding="utf-8") as f:
    for split in splits:
      for d in getattr(corpus, split):
        f.write(json.dumps({"text": d.text, "path": d.path, "sha256": d.sha256}) + "\n")
        n += 1
  return n
