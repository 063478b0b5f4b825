"""A procedural, Colab-scale family of Python repair tasks with hidden tests and a scripted oracle.

Each instance is a tiny project (1-4 modules) whose functions are one-line `return <expr>` bodies under a docstring
that states the intended expression ("Return n > 3."), so the right fix follows from the code the agent reads
(without the spec, a mutated constant could only be guessed). Some functions are broken by one mutation (a wrong
constant, arithmetic operator or comparison), some are stubs to implement, the rest are correct distractors that
must keep working. Hidden tests are a plain-Python script (no pytest start-up) whose expected values come from
evaluating the correct expression, and whose fail-to-pass inputs are ones where the broken expression really differs
(checked by evaluation at generation time).

Difficulty knobs (`ProceduralConfig`): modules, broken functions, stubs, distractors, and whether the prompt names the
file. Level 1 is learnable by a sub-1M-parameter model: one 3-line module, one mutation, an oracle of
read_file -> edit -> finish.

Splits: every function instance has a *core* (template, constants, mutation). A core hashes to "train" or "heldout";
a task belongs to a split only if all its functions' cores do, so held-out tasks only contain (expression, bug)
combinations that no training task contains. Generation is deterministic by seed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import random
import re

from rollout.tasks.grade_report import SCRIPT_REPORTER
from rollout.tasks.task import Environment, HiddenTests, Task

# (template name, argument list, correct expression with {c0}, {c1} constants)
TEMPLATES = (
  ("scale", "x", "x * {c0}"),
  ("shift", "x", "x + {c0}"),
  ("offset", "x", "x - {c0}"),
  ("affine", "x", "x * {c0} + {c1}"),
  ("mix", "a, b", "a * {c0} + b"),
  ("diff", "a, b", "a - b"),
  ("area", "a, b", "a * b"),
  ("at_least", "n", "n >= {c0}"),
  ("below", "n", "n < {c0}"),
  ("above", "n", "n > {c0}"),
  ("equals", "n", "n == {c0}"),
  ("divisible", "n", "n % {c0} == 0"),
  ("bigger", "a, b", "a if a > b else b"),
  ("between", "n", "{c0} <= n <= {c1}"),
)
VERBS = ("get", "calc", "make", "find", "check", "count", "load", "pick", "score", "rate", "price", "size", "sum",
         "next", "last", "base", "total", "fix", "eval", "step", "read", "send", "keep", "move", "draw", "test", "push",
         "pull", "scale", "trim")
NOUNS = ("item", "value", "box", "cost", "page", "user", "line", "tax", "fee", "rate", "node", "cell", "age", "day",
         "level", "limit", "point", "order", "row", "bonus", "score", "size", "step", "price", "word", "tile", "card",
         "seat", "ship", "room")
MODULES = ("calc", "util", "core", "shop", "stats", "rules", "grid", "money", "clock", "parts")
ARITH_SWAPS = {"+": ("-", "*"), "-": ("+",), "*": ("+",)}
COMPARE_SWAPS = {"<": ("<=",), "<=": ("<",), ">": (">=",), ">=": (">",), "==": ("!=",), "!=": ("==",)}
TOKEN_RE = re.compile(r"\d+|<=|>=|==|!=|[-+*%<>]|\w+|\S")
HIDDEN_TEST_FILE = "tests_hidden.py"


@dataclasses.dataclass(frozen=True)
class ProceduralConfig:
  """Difficulty knobs.

  Attributes:
    n_modules: modules in the project (1-4); broken/stub functions are spread over them.
    n_bugs: functions broken by one mutation.
    n_stubs: functions to implement (body `raise NotImplementedError`, spec in the docstring).
    n_distractors: correct functions whose tests must keep passing.
    name_files: whether the prompt names the file(s) to change.
    use_todo: whether the oracle plans with the todo tool (for multi-step levels).
    heldout_percent: share of cores in the held-out split.
  """
  n_modules: int = 1
  n_bugs: int = 1
  n_stubs: int = 0
  n_distractors: int = 0
  name_files: bool = True
  use_todo: bool = False
  heldout_percent: int = 10

  def __post_init__(self):
    if not 1 <= self.n_modules <= 4:
      raise ValueError(f"n_modules must be in 1..4, got {self.n_modules}")
    if self.n_bugs + self.n_stubs < 1:
      raise ValueError("a task needs at least one bug or stub (n_bugs + n_stubs >= 1)")
    if self.n_bugs + self.n_stubs < self.n_modules:
      raise ValueError(f"{self.n_modules=} modules need at least as many bugs + stubs to spread over them")
    if not 0 < self.heldout_percent < 100:
      raise ValueError(f"heldout_percent must be in 1..99, got {self.heldout_percent}")


DIFFICULTY = {
  1: ProceduralConfig(),
  2: ProceduralConfig(n_modules=1, n_bugs=1, n_distractors=1, name_files=False),
  3: ProceduralConfig(n_modules=2, n_bugs=2, n_distractors=1, name_files=False, use_todo=True),
  4: ProceduralConfig(n_modules=3, n_bugs=2, n_stubs=1, n_distractors=2, name_files=False, use_todo=True),
}


@dataclasses.dataclass(frozen=True)
class _Fn:
  name: str
  args: str
  correct: str
  shown: str  # the expression in the file (== correct for distractors)
  kind: str  # "bug" | "stub" | "ok"
  core: str
  module: str = ""

  def statement(self) -> str:
    """The body as the file has it: a stub's `raise`, else `return` of the shown expression."""
    return "raise NotImplementedError" if self.kind == "stub" else f"return {self.shown}"

  def source(self) -> str:
    return f"{self.header()}    {self.statement()}\n"

  def header(self) -> str:
    """The signature and the docstring that states the intended expression (the spec a fix must meet)."""
    return f'def {self.name}({self.args}):\n    """Return {self.correct}."""\n'


def _split_of(core: str, heldout_percent: int) -> str:
  h = int(hashlib.sha256(core.encode()).hexdigest()[:8], 16) % 100
  return "heldout" if h < heldout_percent else "train"


def _mutations(expr: str) -> list[str]:
  """Every single-token mutation of `expr`: constants +-1/+2, arithmetic and comparison operator swaps."""
  toks = TOKEN_RE.findall(expr)
  out = []
  for i, t in enumerate(toks):
    subs = []
    if t.isdigit():
      subs = [str(int(t) + d) for d in (1, -1, 2) if int(t) + d > 0]
    elif t in ARITH_SWAPS:
      subs = list(ARITH_SWAPS[t])
    elif t in COMPARE_SWAPS:
      subs = list(COMPARE_SWAPS[t])
    for s in subs:
      out.append(" ".join(toks[:i] + [s] + toks[i + 1:]))
  return [_normalise(m) for m in out]


def _normalise(expr: str) -> str:
  return " ".join(TOKEN_RE.findall(expr))


def _inputs(args: str) -> list[tuple[int, ...]]:
  vals = range(-2, 13)
  return [(v,) for v in vals] if args.count(",") == 0 else [(a, b) for a in range(-2, 9) for b in (0, 1, 3, 7)]


@functools.lru_cache(maxsize=65536)
def _compile(args: str, expr: str):
  return eval(f"lambda {args}: {expr}")  # our own generated expressions, never model output


def _eval(args: str, expr: str, inp: tuple[int, ...]):
  return _compile(args, expr)(*inp)


def _sample_fn(rng: random.Random, split: str, kind: str, used_names: set[str], heldout_percent: int) -> _Fn:
  """Samples one function whose core lies in `split` (rejection sampling)."""
  for _ in range(10_000):
    tname, args, template = rng.choice(TEMPLATES)
    c0 = rng.randint(2, 9)
    c1 = rng.randint(c0 + 1, c0 + 6) if "{c1}" in template and tname == "between" else rng.randint(1, 9)
    correct = _normalise(template.format(c0=c0, c1=c1))
    shown = correct
    if kind == "bug":
      muts = [m for m in _mutations(correct) if m != correct]
      shown = rng.choice(muts)
    core = f"{correct}|{shown}|{kind}"
    if _split_of(core, heldout_percent) != split:
      continue
    ins = _inputs(args)
    if kind == "bug":
      if not any(_eval(args, correct, i) != _eval(args, shown, i) for i in ins):
        continue  # an equivalent mutation would give a test that cannot fail
    name = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
    if name in used_names:
      continue
    used_names.add(name)
    return _Fn(name, args, correct, shown, kind, core)
  raise RuntimeError(f"could not sample a {kind} function for split {split!r}")


def _test_source(fn: _Fn, rng: random.Random) -> tuple[str, str | None]:
  """(fail-to-pass or keep-passing test, optional basic test) sources for one function."""
  ins = _inputs(fn.args)
  broken = fn.kind != "ok"
  differ = [i for i in ins if fn.kind == "stub" or _eval(fn.args, fn.correct, i) != _eval(fn.args, fn.shown, i)]
  agree = [i for i in ins if i not in differ]
  chosen = rng.sample(differ, min(2, len(differ))) + rng.sample(agree, min(1, len(agree))) if broken else \
    rng.sample(ins, 3)

  def body(cases):
    lines = [f"    from {fn.module} import {fn.name}"]
    lines += [f"    assert {fn.name}({', '.join(map(str, c))}) == {_eval(fn.args, fn.correct, c)!r}" for c in cases]
    return "\n".join(lines) + "\n"

  main = f"def test_{fn.name}():\n" + body(chosen)
  basic = None
  if fn.kind == "bug" and len(agree) >= 2:
    basic = f"def test_{fn.name}_basic():\n" + body(rng.sample(agree, 2))
  return main, basic


def _hidden_script(tests: list[str]) -> str:
  names = [t.split("(")[0][4:] for t in tests]
  # The reporter takes the report path and nonce out of the environment before any code under test is imported
  # (see grade_report); a result is written as each test finishes.
  runner = ("\n\n" + SCRIPT_REPORTER + "\n\nimport sys\nsys.path.insert(0, '.')\n"
            "failed = 0\nfor _t in [" + ", ".join(names) + "]:\n"
            "    try:\n        _t()\n        _write(_t.__name__, 'passed')\n"
            "    except Exception:\n        failed += 1\n        _write(_t.__name__, 'failed')\n"
            "sys.exit(1 if failed else 0)\n")
  return "\n\n".join(tests) + runner


def _edit_call(path: str, old: str, new: str) -> dict:
  return {"name": "edit", "arguments": {"path": path, "old": old, "new": new}}


def _oracle(cfg: ProceduralConfig, fixes: list[_Fn], files: dict[str, str]) -> list[dict]:
  """The scripted trajectory: assistant messages with tool calls (the last one calls finish)."""
  turns = []
  if cfg.use_todo:
    items = [f"fix {f.name}" for f in fixes]
    turns.append({"content": "", "tool_calls": [{"name": "todo", "arguments": {"add": items}}]})
  for k, fn in enumerate(fixes):
    path = f"{fn.module}.py"
    if not cfg.name_files:
      turns.append({"content": "", "tool_calls": [{"name": "grep", "arguments": {"pattern": f"def {fn.name}"}}]})
    turns.append({"content": "", "tool_calls": [{"name": "read_file", "arguments": {"path": path}}]})
    if fn.kind == "stub":
      old, new = f"    {fn.statement()}\n", f"    return {fn.correct}\n"
      old = f'"""Return {fn.correct}."""\n' + old
      new = f'"""Return {fn.correct}."""\n' + new
    else:
      old, new = fn.statement(), f"return {fn.correct}"
      # Another function can share the buggy line (levels 2-3 put several in a file): widen the match to the
      # docstring line, and only if that is still ambiguous to the whole header (the shortest unique edit).
      for context in (f'"""Return {fn.correct}."""\n    ', fn.header() + "    "):
        if files[path].count(old) == 1:
          break
        old, new = context + fn.statement(), context + f"return {fn.correct}"
    calls = [_edit_call(path, old, new)]
    if cfg.use_todo:
      calls.append({"name": "todo", "arguments": {"done": [k + 1]}})
    turns.append({"content": "", "tool_calls": calls})
  names = ", ".join(f.name for f in fixes)
  turns.append({"content": "", "tool_calls": [{"name": "finish", "arguments": {"message": f"Fixed {names}."}}]})
  return turns


def _oracle_summaries(cfg: ProceduralConfig, fixes: list[_Fn]) -> list[str]:
  """The oracle's self-summary after each number of completed turns k (`summaries[k]`, k = 0..len(oracle)).

  A summary replaces the context, so it carries what the next segment cannot see again: which functions are fixed,
  which file a grep found a function in, and, once a file was read, the edit to make (`path: old -> new`; the next
  segment has no copy of the file). It starts with the step count, which the scripted oracle resumes from (and
  which survives a summary cut at `summary_max_tokens`); the todo list needs no copy (it lives in the episode's
  tools, not in the context).
  """
  # Turn indices as `_oracle` lays them out: [todo], then per fix [grep], read, edit; then finish.
  t, steps = int(cfg.use_todo), []
  for _ in fixes:
    grep = t if not cfg.name_files else None
    t += grep is not None
    steps.append((grep, t, t + 1))
    t += 2
  out = []
  for k in range(t + 2):
    parts = [f"completed steps: {k}."]
    for fn, (grep, read, edit) in zip(fixes, steps, strict=True):
      path = f"{fn.module}.py"
      if edit < k:
        parts.append(f"Fixed {fn.name}.")
      elif read < k:
        parts.append(f"`{path}`: `{fn.statement()}` -> `return {fn.correct}`.")
      elif cfg.name_files or (grep is not None and grep < k):
        parts.append(f"{fn.name} is in `{path}`.")
      else:
        parts.append(f"Left: {fn.name}.")
    out.append(" ".join(parts))
  return out


def _unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
  parts = []
  for path in sorted(after):
    if before[path] != after[path]:
      parts += difflib.unified_diff(before[path].splitlines(True), after[path].splitlines(True),
                                    f"a/{path}", f"b/{path}")
  return "".join(parts)


def make_task(rng: random.Random, cfg: ProceduralConfig, split: str, level: int | None = None) -> Task:
  """One task instance of `split` ('train' | 'heldout')."""
  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  used: set[str] = set()
  kinds = ["bug"] * cfg.n_bugs + ["stub"] * cfg.n_stubs
  fns = [_sample_fn(rng, split, k, used, cfg.heldout_percent) for k in kinds]
  fns += [_sample_fn(rng, split, "ok", used, cfg.heldout_percent) for _ in range(cfg.n_distractors)]
  modules = rng.sample(MODULES, cfg.n_modules)
  # Broken functions are spread round-robin so every module has one; distractors land anywhere.
  fns = [dataclasses.replace(f, module=modules[i % cfg.n_modules] if f.kind != "ok" else rng.choice(modules))
         for i, f in enumerate(fns)]
  order = fns[:]
  rng.shuffle(order)
  before = {f"{m}.py": "\n\n".join(f.source() for f in order if f.module == m) for m in modules}
  fixed = [dataclasses.replace(f, kind="ok", shown=f.correct) for f in order]
  after = {f"{m}.py": "\n\n".join(f.source() for f in fixed if f.module == m) for m in modules}
  fixes = [f for f in fns if f.kind != "ok"]
  f2p, p2p, tests = [], [], []
  for fn in fns:
    main, basic = _test_source(fn, rng)
    tests.append(main)
    (f2p if fn.kind != "ok" else p2p).append(f"test_{fn.name}")
    if basic:
      tests.append(basic)
      p2p.append(f"test_{fn.name}_basic")
  bugs, stubs = [f for f in fixes if f.kind == "bug"], [f for f in fixes if f.kind == "stub"]
  # Backticks make the path the same tokens as in a tool call's JSON string ("core.py" after a quote), where the
  # plain " core.py" would be " core" — a small model then has to learn to copy across tokenisations.
  where = (lambda f: f" in `{f.module}.py`") if cfg.name_files else (lambda f: "")
  parts = []
  if bugs:
    parts.append("Fix " + ", ".join(f"{f.name}{where(f)}" for f in bugs) + ".")
  if stubs:
    parts.append("Implement " + ", ".join(f"{f.name}{where(f)}" for f in stubs) + ".")
  digest = hashlib.sha256(repr(sorted(before.items())).encode()).hexdigest()[:12]
  gold = _unified_diff(before, after)
  return Task(
    id=f"proc/{split}/{digest}", language="python", prompt=" ".join(parts),
    environment=Environment(files=before),
    # -I -S: no site-packages or env vars needed, and ~40% less interpreter start-up (grading is on the RL path).
    tests=HiddenTests(command=f"python3 -I -S {HIDDEN_TEST_FILE}", fail_to_pass=tuple(f2p), pass_to_pass=tuple(p2p),
                      files={HIDDEN_TEST_FILE: _hidden_script(tests)}, timeout_s=20.0, report="script"),
    gold_patch=gold,
    metadata={"source": "procedural", "split": split, "level": level, "cores": [f.core for f in fns],
              "changed_files": sorted(p for p in before if before[p] != after[p]),
              "changed_lines": sum(1 for line in gold.splitlines() if line.startswith("-") and
                                   not line.startswith("---")),
              "oracle": _oracle(cfg, fixes, before), "oracle_summaries": _oracle_summaries(cfg, fixes)})


def generate(n: int, *, seed: int = 0, split: str = "train", level: int = 1,
             cfg: ProceduralConfig | None = None) -> list[Task]:
  """`n` distinct tasks of one split, deterministic in (seed, split, level/cfg).

  Args:
    n: number of tasks.
    seed: generator seed.
    split: 'train' or 'heldout' (disjoint cores, see the module docstring).
    level: a preset from `DIFFICULTY` (ignored when `cfg` is given).
    cfg: explicit difficulty knobs.
  """
  if cfg is None:
    if level not in DIFFICULTY:
      raise ValueError(f"unknown difficulty level {level}; valid: {sorted(DIFFICULTY)}")
    cfg = DIFFICULTY[level]
  rng = random.Random(f"{seed}/{split}/{cfg}")
  tasks, seen = [], set()
  for _ in range(20 * n + 1000):
    if len(tasks) == n:
      break
    task = make_task(rng, cfg, split, level)
    if task.id not in seen:
      seen.add(task.id)
      tasks.append(task)
  if len(tasks) < n:
    raise ValueError(f"only {len(tasks)} distinct {split} tasks exist for {cfg}; asked for {n}")
  return tasks


def near_miss(task: Task, rng: random.Random) -> Task:
  """`task` with an oracle that makes a plausible wrong fix: one broken function gets a different single-token change
  of its intended expression (an imperfect demonstration, like an unfiltered trajectory of a weaker teacher)."""
  fixes = [c.split("|") for c in task.metadata["cores"] if not c.endswith("|ok")]
  correct, shown, _ = fixes[rng.randrange(len(fixes))]
  # Another one-token change of the right expression, or (when it has none, e.g. `a - b`) of the broken one.
  wrong = [m for m in _mutations(correct) if m not in (correct, shown)] or \
    [m for m in _mutations(shown) if m not in (correct, shown)]
  turns, chosen = [], None
  for turn in task.metadata["oracle"]:
    calls = []
    for call in turn["tool_calls"]:
      new = call["arguments"].get("new", "")
      if call["name"] == "edit" and f"return {correct}\n" in new + "\n" and wrong:
        chosen = rng.choice(wrong)
        call = {"name": "edit", "arguments": {**call["arguments"],
                                              "new": new.replace(f"return {correct}", f"return {chosen}")}}
        wrong = []  # one wrong edit per demonstration
      calls.append(call)
    turns.append({**turn, "tool_calls": calls})
  meta = {**task.metadata, "oracle": turns, "near_miss": True}
  if chosen is not None and "oracle_summaries" in meta:  # a summary plans the same wrong edit the demo makes
    meta["oracle_summaries"] = [s.replace(f"-> `return {correct}`", f"-> `return {chosen}`")
                                for s in meta["oracle_summaries"]]
  return dataclasses.replace(task, metadata=meta)
