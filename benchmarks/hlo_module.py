"""A compiled HLO module's text as a table: computations, instructions, and how often each computation runs.

Shared by `hlo_collectives.py` (collectives), `hlo_costs.py` (FLOPs, the peak's buffers) and `scale_plan.py`.
A computation inside a `while` body runs once per iteration: `times` follows `while` loops' known trip counts
(a loop without one is an error) and every other call (`calls=`, `to_apply=`), so a scanned layer stack's
instructions are counted once per layer. A `conditional` runs one of its branches: only its heaviest branch is
counted (the most bytes computed, loops and calls included; an upper bound of what runs), the others get no
executions. Counting every branch would, e.g., count both halves of each zig-zag ring step (`lax.cond(earlier,
later)`), twice the attention that runs. XLA's own `cost_analysis()` counts a while body once, which is why the
FLOPs here are counted from this table instead.
"""
from __future__ import annotations

import dataclasses
import re

_COMP_START = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
# `%name = type opcode(operands), attributes`; a tuple type is parenthesised and holds no parentheses itself.
_INSTR = re.compile(r"^\s*(ROOT )?%([^\s=]+) = (\([^()]*\)|\S+) ([a-z][\w\-]*)\(([^)]*)\)(.*)$")
_SHAPE = re.compile(r"\b(pred|token|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Ops that compute nothing (they name or bundle existing buffers): left out of a branch's weight.
_PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}

BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e8m0fnu": 8,
        "f4e2m1fn": 4, "bf16": 16, "f16": 16, "s16": 16, "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64,
        "s64": 64, "u64": 64, "token": 0}


def element_types(result_type: str) -> list[tuple[str, tuple[int, ...]]]:
  """[(dtype, dims)] of an HLO type string (one entry per tuple element)."""
  out = []
  for dtype, dims in _SHAPE.findall(result_type):
    if dtype not in BITS:
      raise ValueError(f"unknown HLO element type {dtype!r} in {result_type!r}; add it to hlo_module.BITS")
    out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
  return out


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
  n = 1
  for d in dims:
    n *= d
  return n * BITS[dtype] // 8


def branches_of(ins) -> list[str]:  # noqa: N802
  """A conditional's branch computations (`branch_computations=` or `true_/false_computation=`), else []."""
  if ins.opcode != "conditional":
    return []
  if b := _BRANCHES.search(ins.attrs):
    return [c.strip().lstrip("%") for c in b.group(1).split(",")]
  return re.findall(r"\b(?:true|false)_computation=%([\w.\-]+)", ins.attrs)


@dataclasses.dataclass
class Instr:
  name: str
  type: str                 # the result type text
  opcode: str
  operands: list[str]
  attrs: str                # everything after the operand list (attributes, metadata)
  computation: str
  root: bool
  line: str

  @property
  def op_name(self) -> str:
    m = _OP_NAME.search(self.attrs)
    return m.group(1).replace("\\'", "'") if m else ""

  @property
  def callees(self) -> list[str]:
    out = _CALLEE.findall(self.attrs)
    if b := _BRANCHES.search(self.attrs):
      out += [c.strip().lstrip("%") for c in b.group(1).split(",")]
    return out


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instr]]
  entry: str
  instrs: dict[str, Instr]          # by name (names are unique in a module)
  times: dict[str, int]             # computation -> executions per run of the module
  callers: dict[str, str] = dataclasses.field(default_factory=dict)   # fused/called computation -> a caller's name

  def root(self, computation: str) -> Instr:
    return next(i for i in self.computations[computation] if i.root)


def parse_module(text: str) -> Module:
  """Parses compiled HLO text (`compiled.as_text()`) and counts each computation's executions per step."""
  comps: dict[str, list[Instr]] = {}
  entry, cur = None, None
  for line in text.splitlines():
    if cur is None:
      m = _COMP_START.match(line)
      if m:
        cur = m.group(2)
        comps[cur] = []
        entry = cur if m.group(1) else entry
    elif line.strip() == "}":
      cur = None
    else:
      m = _INSTR.match(line)
      if m:
        operands = re.findall(r"%([\w.\-]+)", m.group(5))
        comps[cur].append(Instr(m.group(2), m.group(3), m.group(4), operands, m.group(6), cur, bool(m.group(1)),
                                line))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  instrs = {i.name: i for body in comps.values() for i in body}
  times: dict[str, int] = {}
  weights: dict[str, int] = {}

  def weight(name: str, depth: int = 0) -> int:
    """Bytes a computation computes per execution (results of all but `_PLUMBING` ops), its loops and calls
    included, of a conditional its heaviest branch."""
    if name not in weights:
      if depth > 100:
        raise ValueError(f"HLO call graph deeper than 100 at {name}")
      total = 0
      for ins in comps.get(name, []):
        branches = [c for c in branches_of(ins) if c in comps]
        trip = _TRIP.search(ins.attrs) if ins.opcode == "while" else None
        body = re.search(r"\bbody=%([\w.\-]+)", ins.attrs).group(1) if trip else None
        if ins.opcode not in _PLUMBING:
          total += sum(nbytes(d, dims) for d, dims in element_types(ins.type))
        total += max((weight(c, depth + 1) for c in branches), default=0)
        total += sum(weight(c, depth + 1) * (int(trip.group(1)) if c == body else 1)
                     for c in ins.callees if c in comps and c not in branches)
      weights[name] = total
    return weights[name]

  def visit(name: str, mult: int, depth: int = 0):
    if depth > 100:
      raise ValueError(f"HLO call graph deeper than 100 at {name}")
    times[name] = times.get(name, 0) + mult
    for ins in comps.get(name, []):
      callees = ins.callees
      if ins.opcode == "while":
        trip = _TRIP.search(ins.attrs)
        if trip is None:
          raise ValueError(f"a while loop without a known trip count: {ins.line[:200]}")
        body = re.search(r"\bbody=%([\w.\-]+)", ins.attrs).group(1)
        visit(body, mult * int(trip.group(1)), depth + 1)
        callees = [c for c in callees if c != body]
      branches = [c for c in branches_of(ins) if c in comps]
      if branches:
        visit(max(branches, key=weight), mult, depth + 1)
        callees = [c for c in callees if c not in branches]
      for c in callees:
        if c in comps:
          visit(c, mult, depth + 1)
  visit(entry, 1)
  callers = {c: ins.name for ins in instrs.values() for c in ins.callees}
  return Module(comps, entry, instrs, times, callers)
