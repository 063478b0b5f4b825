"""What a compiled HLO module computes and holds: matmul FLOPs (loops counted per iteration) and the peak's buffers.

Used by `scale_plan.py`.
- **FLOPs**: 2 x result elements x contracted size, summed over every `dot` of the per-device module (fusions
  included), each weighted by how often its computation runs (`hlo_module`: while loops' trip counts). XLA's
  `cost_analysis()["flops"]` counts a while body once, so a scanned 61-layer stack would show one layer.
  Elementwise work is left out: the plan compares this with the model's matmul FLOPs, so what shows is matmuls
  done more than once (remat, or a whole-batch op each device repeats).
- **The peak's buffers**: XLA writes the values live at the peak of its buffer assignment into the
  `*-live-range.txt` dump (`--xla_dump_to`; `dump_flags`). Each is attributed to the JAX op it came from (the
  instruction's `op_name` metadata, else its fused computation's, else its first operand's), and marked
  **XLA:CPU-only** when a GPU compile would not hold it: f32 copies that XLA:CPU makes of bf16 values
  (a `convert` from bf16, possibly followed by relayout `copy`s: it has no bf16 arithmetic), and the widened half of
  an f32 collective result whose operand was bf16 (`hlo_collectives.program_elements`).
  A copy is wholly CPU-only only while its bf16 original is live too: a GPU reads the original instead. Where the
  original is *not* live at the peak (XLA:CPU converts a stack the forward scan saved for the backward and frees
  the bf16 stack), a GPU would hold a bf16 value of the copy's shape in its place (that stack, or the broadcast of
  a bf16 scalar a scatter-add starts from), so the copies of one original count as CPU-only less half the largest
  copy (`peak_buffers`: `holds_instead` names the original).
"""
from __future__ import annotations

import glob
import math
import os
import re

from benchmarks.hlo_collectives import LAYOUT_OPS, NARROW, _narrowed_from, program_elements
from benchmarks.hlo_module import Module, element_types

_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):\s*$")
_LIVE = re.compile(r"^\s*([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")
_PARAM_NUMBER = re.compile(r"\bparameter\((\d+)\)")
_GTE_INDEX = re.compile(r"\bindex=(\d+)")


def dump_flags(directory: str) -> str:
  """XLA_FLAGS that make XLA write each compiled module's text, buffer assignment and live ranges to `directory`."""
  return f"--xla_dump_to={directory} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"


def dot_flops(module: Module) -> dict[str, float]:
  """Matmul FLOPs per execution of the module: total, and by the source op's top-level name scope."""
  total, by_scope = 0.0, {}
  for comp, body in module.computations.items():
    times = module.times.get(comp, 0)
    if not times:
      continue
    shapes = {i.name: element_types(i.type) for i in body}
    for ins in body:
      if ins.opcode == "convolution":
        raise ValueError(f"convolution in the module ({ins.name}); dot_flops counts dots only")
      if ins.opcode != "dot":
        continue
      (_, out_dims), = element_types(ins.type)
      (_, lhs_dims), = shapes.get(ins.operands[0]) or element_types(module.instrs[ins.operands[0]].type)
      contracted = math.prod(lhs_dims[int(d)] for d in _CONTRACT.search(ins.attrs).group(1).split(",") if d)
      f = 2.0 * math.prod(out_dims) * contracted * times
      total += f
      scope = _scope(_source(module, ins.name))
      by_scope[scope] = by_scope.get(scope, 0.0) + f
  return {"total": total, "by_scope": dict(sorted(by_scope.items(), key=lambda kv: -kv[1]))}


def _scope(op_name: str) -> str:
  """`jit(train_step)/transpose(jvp(lm_head))/while/body/dot_general` -> `lm_head`: the innermost named scope of
  the model that the op sits in, as a short label for tables."""
  for label in ("lm_head", "attention", "ep_capacity", "ep_ragged", "moe", "mlp", "mtp"):
    if label in op_name:
      return label
  return "other"


def _source(module: Module, name: str, depth: int = 0) -> str:
  """The JAX op an instruction came from: its metadata, its fused computation's, its first operand's, or (inside a
  fused computation whose ops carry none, e.g. a matmul XLA:CPU fused into a library call) its caller's."""
  ins = module.instrs.get(name)
  if ins is None or depth > 8:
    return ""
  if ins.op_name:
    return ins.op_name
  for callee in ins.callees:
    for inner in reversed(module.computations.get(callee, [])):
      if inner.op_name:
        return inner.op_name
  found = _source(module, ins.operands[0], depth + 1) if ins.operands else ""
  caller = module.callers.get(ins.computation)
  return found or (_source(module, caller, depth + 1) if caller else "")


def _only_layout_and_converts(module: Module, ins) -> bool:
  ops = ({i.opcode for i in module.computations[ins.callees[0]]} if ins.opcode == "fusion" and ins.callees
         else {ins.opcode})
  return ops <= {"parameter", "convert", *LAYOUT_OPS}


def cpu_only_bytes(module: Module, name: str, index: tuple[int, ...], size: int) -> int:
  """Bytes of one live buffer that a GPU compile would not hold (see the module docstring): all of an f32 copy of
  an existing bf16 value, half of an f32 value the program has in bf16 (XLA:CPU rounds it through bf16 and keeps
  it widened), half of a widened collective's result."""
  ins = module.instrs.get(name)
  if ins is None:
    return 0
  elems = element_types(ins.type)
  dtype = elems[index[0] if index and len(elems) > 1 else 0][0] if elems else ""
  if dtype != "f32":
    return 0
  if ins.opcode in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
    prog = program_elements(module, ins)
    i = index[0] if index and len(prog) > 1 else 0
    return size // 2 if prog[i][0] in NARROW else 0
  if not _only_layout_and_converts(module, ins):
    return 0
  widened = _narrow_convert(module, ins)
  if widened == "copy":
    return size
  if widened == "round_trip" or _narrowed_from(module, name):
    return size // 2
  src = ins.operands[0] if ins.operands else None
  return size if src and cpu_only_bytes(module, src, (), 2) == 2 else 0


def _narrow_convert(module: Module, ins) -> str | None:
  """"copy" if the (fused) instruction converts an existing bf16 buffer (its operand) to f32, "round_trip" if it
  widens a bf16 value it computed itself (f32 -> bf16 -> f32), else None."""
  converted = _converted(module, ins)
  return None if converted is None else "round_trip" if converted[1] else "copy"


def _converted(module: Module, ins) -> tuple[str, bool] | None:
  """(the name of the bf16 value a (fused) instruction converts to f32 — in the enclosing computation when it is
  the fusion's operand —, whether the fusion computed that value itself), or None if it converts none."""
  body = module.computations[ins.callees[0]] if ins.opcode == "fusion" and ins.callees else [ins]
  local = {i.name: i for i in body}
  for i in body:
    if i.opcode != "convert" or not i.operands:
      continue
    src = local.get(i.operands[0]) or module.instrs.get(i.operands[0])
    if src is None or element_types(src.type)[0][0] not in NARROW:
      continue
    if src.name in local and src.opcode != "parameter" and ins.opcode == "fusion":
      return src.name, True
    if src.opcode == "parameter" and ins.opcode == "fusion":
      return ins.operands[int(_PARAM_NUMBER.search(src.line).group(1))], False
    return src.name, False
  return None


def _buffer(module: Module, name: str) -> tuple[str, tuple[int, ...]]:
  """The buffer a value lives in, as the live-range dump names it: (defining instruction, tuple index), looking
  through `bitcast`s and `get-tuple-element`s (which name an existing buffer)."""
  index: tuple[int, ...] = ()
  for _ in range(64):
    ins = module.instrs.get(name)
    if ins is None or ins.opcode not in ("bitcast", "get-tuple-element") or not ins.operands:
      break
    if ins.opcode == "get-tuple-element":
      index = (int(_GTE_INDEX.search(ins.attrs).group(1)),) + index
    name = ins.operands[0]
  return name, index


def bf16_original(module: Module, name: str, depth: int = 0) -> tuple[str, tuple[int, ...]] | None:
  """For an f32 copy of a bf16 value (a converting fusion, or a relayout copy of such a copy): the buffer of the bf16
  original (`_buffer`), else None."""
  ins = module.instrs.get(name)
  if ins is None or depth > 20 or not _only_layout_and_converts(module, ins):
    return None
  converted = _converted(module, ins)
  if converted is not None:
    return None if converted[1] else _buffer(module, converted[0])
  return bf16_original(module, ins.operands[0], depth + 1) if ins.operands else None


def live_range_text(directory: str, module_name: str) -> str:
  """The newest `*-live-range.txt` XLA dumped for the module named `module_name` (e.g. jit_train_step)."""
  files = glob.glob(os.path.join(directory, f"module_*.{module_name}.*live-range.txt"))
  if not files:
    raise FileNotFoundError(f"no live-range dump of {module_name} in {directory}; was XLA_FLAGS "
                            f"{dump_flags(directory)!r} set before jax was imported?")
  with open(max(files, key=os.path.getmtime)) as f:
    return f.read()


def _hold_originals_not_live(module: Module, buffers: list[dict]) -> None:
  """The copies of a bf16 original that is not live at the peak: a GPU holds a bf16 value of their shape in their
  place, so the largest copy's CPU-only bytes drop by half and it names the original."""
  live = {(b["name"], b["index"]) for b in buffers}
  copies: dict[tuple, list[dict]] = {}
  for b in buffers:
    if b["cpu_only"] == b["bytes"] > 0 and (original := bf16_original(module, b["name"])) is not None:
      copies.setdefault(original, []).append(b)
  for (name, index), group in copies.items():
    if (name, index) not in live:
      largest = max(group, key=lambda b: b["bytes"])
      largest["cpu_only"] -= largest["bytes"] // 2
      largest["holds_instead"] = name + "{" + ",".join(map(str, index)) + "}"


def peak_buffers(module: Module, live_range: str, top: int = 12) -> dict:
  """The buffers live at the peak: total and XLA:CPU-only bytes, the largest sources, the largest buffers."""
  lines = live_range.splitlines()
  start = next((i for i, line in enumerate(lines) if _PEAK.match(line)), None)
  if start is None:
    raise ValueError("no 'Live ranges at N (peak):' section in the live-range dump")
  buffers = []
  for line in lines[start + 1:]:
    m = _LIVE.match(line)
    if not m:
      break
    name, index, size = m.group(1), tuple(int(x) for x in m.group(2).split(",") if x), int(m.group(3))
    ins = module.instrs.get(name)
    buffers.append({"name": name, "index": index, "bytes": size, "type": ins.type if ins else "",
                    "source": _source(module, name), "cpu_only": cpu_only_bytes(module, name, index, size)})
  _hold_originals_not_live(module, buffers)
  by_source: dict[str, dict] = {}
  for b in buffers:
    s = by_source.setdefault(b["source"], {"bytes": 0, "cpu_only": 0, "buffers": 0})
    s["bytes"] += b["bytes"]
    s["cpu_only"] += b["cpu_only"]
    s["buffers"] += 1
  return {"bytes": sum(b["bytes"] for b in buffers), "cpu_only_bytes": sum(b["cpu_only"] for b in buffers),
          "by_source": [{"source": k, **v} for k, v in sorted(by_source.items(), key=lambda kv: -kv[1]["bytes"])
                        ][:top],
          "largest": sorted(buffers, key=lambda b: -b["bytes"])[:top]}

