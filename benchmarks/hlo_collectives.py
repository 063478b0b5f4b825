"""Collectives of a compiled (per-device, SPMD-partitioned) HLO module: kind, bytes, group size, intra/inter node.

Used by `scale_plan.py`. Bytes are counted in the element types the *program* has, not XLA:CPU's: its
`float-normalization-bf16` pass upcasts every bf16 collective to f32 (the CPU runtime has no bf16 reductions),
which a GPU does not (NCCL moves and reduces bf16). The pass leaves a mark on each operand it widens: the
operand is computed by a `convert` to f32 of a bf16 value (often bf16 -> f32 -> bf16 -> f32, fused), reached from
the operand's root through layout-only ops (f8 exchanges are widened to f16 the same way). Each element of a
collective, tuples included (XLA:CPU emits all-to-alls and combined all-reduces with one operand per piece), is
counted in the narrow type when its operand carries that mark, so no dump of an earlier pass and no matching of
channel ids (which the combiners reuse) is needed. (A program that itself widens an f8/bf16 value just before a
collective would be counted in the narrow type too.)

Bytes per device are the size of the buffer the op produces (for `reduce-scatter`: its input, the group size times
its result) and the bytes a device sends over the wire under the usual ring / pairwise algorithms, for a group of n:
all-gather, reduce-scatter, all-to-all: (n-1)/n x buffer; all-reduce: 2 (n-1)/n x buffer; collective-permute: the
buffer, unless the pair is a device to itself (sent nowhere).
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from benchmarks.hlo_module import BITS, Module, element_types, nbytes, parse_module

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                          r"\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
# Ops that move or relabel elements without computing: walked through when looking for the upcast's convert.
LAYOUT_OPS = ("bitcast", "copy", "reshape", "transpose", "slice", "broadcast")
NARROW = ("bf16", "f16")     # what XLA:CPU widens to f32 (for hlo_costs' CPU-only bytes)
FLOATS = ("f8e4m3fn", "f8e5m2", "f8e4m3", "bf16", "f16", "f32")   # f8 collectives XLA:CPU widens to f16


def _narrowed_from(module: Module, name: str, depth: int = 0) -> str | None:
  """The narrower float type (bf16, f16, f8) a value was widened from by a `convert` (see the module docstring),
  looking through fusions and layout-only ops; None if the value is computed in its own type."""
  ins = module.instrs.get(name)
  if ins is None or depth > 20:
    return None
  if ins.opcode == "fusion":
    callee = ins.callees[0] if ins.callees else None
    return _narrowed_from(module, module.root(callee).name, depth + 1) if callee in module.computations else None
  if ins.opcode == "convert":
    src = module.instrs.get(ins.operands[0]) if ins.operands else None
    src_types, out_types = (element_types(src.type) if src is not None else []), element_types(ins.type)
    if len(src_types) == 1 and len(out_types) == 1 and src_types[0][0] in FLOATS and out_types[0][0] in FLOATS \
        and BITS[src_types[0][0]] < BITS[out_types[0][0]]:
      return src_types[0][0]
    return None
  if ins.opcode in LAYOUT_OPS and ins.operands:
    return _narrowed_from(module, ins.operands[0], depth + 1)
  return None


def program_elements(module: Module, ins) -> list[tuple[str, tuple[int, ...]]]:
  """A collective's result elements [(dtype, dims)], f32 ones that were widened from bf16 counted as bf16."""
  elems = element_types(ins.type)
  if ins.opcode.startswith("reduce-scatter") or len(ins.operands) != len(elems):
    sources = [ins.operands[0]] * len(elems) if len(ins.operands) == 1 else [None] * len(elems)
  else:
    sources = ins.operands
  out = []
  for (dtype, dims), src in zip(elems, sources):
    narrow = _narrowed_from(module, src) if (dtype in ("f16", "f32") and src) else None
    out.append((narrow or dtype, dims))
  return out


def _ints(s: str) -> list[int]:
  return [int(x) for x in s.split(",") if x]


def replica_groups(line: str, n_devices: int) -> list[list[int]]:
  """The device groups of one collective line (`mesh[...] {axes}`, iota `[g,n]<=[...]` or explicit lists)."""
  if m := _MESH_GROUPS.search(line):
    axes = [a.split("=") for a in m.group(1).split(",")]
    names, sizes = [a.strip("'") for a, _ in axes], [int(s) for _, s in axes]
    ids = np.arange(math.prod(sizes))
    if m.group(2):
      ids = ids.reshape(_ints(m.group(2)))
      if m.group(3):
        ids = ids.transpose(_ints(m.group(3)))
    ids = ids.reshape(sizes)
    group_axes = [g.strip().strip("'") for g in m.group(4).split(",") if g.strip()]
    if any(g not in names for g in group_axes):
      raise ValueError(f"cannot parse replica group axes {m.group(4)!r} of mesh {names}: {line[:200]}")
    pos = [names.index(g) for g in group_axes]
    rest = [i for i in range(len(names)) if i not in pos]
    return ids.transpose(rest + pos).reshape(-1, math.prod(sizes[i] for i in pos) if pos else 1).tolist()
  if m := _IOTA_GROUPS.search(line):
    ids = np.arange(math.prod(_ints(m.group(3)))).reshape(_ints(m.group(3)))
    if m.group(4):
      ids = ids.transpose(_ints(m.group(4)))
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
  if m := _LIST_GROUPS.search(line):
    groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return groups if groups and groups[0] else [list(range(n_devices))]
  if "replica_groups={}" in line or "replica_groups" not in line:
    return [list(range(n_devices))]
  raise ValueError(f"cannot parse the replica groups of: {line[:300]}")


@dataclasses.dataclass
class Collective:
  kind: str
  buffer_bytes: int      # per device: the op's result (reduce-scatter: its input)
  wire_bytes: float      # per device, sent over links (ring / pairwise algorithms)
  group_size: int
  inter_node: bool       # some group spans more than one node
  times: int = 1         # executions per step (trip counts of enclosing while loops); bytes above include it
  op_name: str = ""      # the JAX op it came from (metadata): `.../shard_map/...` is ours, else the partitioner's


def parse(compiled: str | Module, n_devices: int, devices_per_node: int = 8, program_dtypes: bool = True
          ) -> list[Collective]:
  """Every collective of the compiled per-device module (text or `hlo_module.parse_module`'s table).

  With `program_dtypes`, elements XLA:CPU widened from bf16 are counted in bf16 (`program_elements`). A collective
  inside a `while` body is counted once per iteration (the loop's known trip count; a loop without one is an error).
  """
  module = parse_module(compiled) if isinstance(compiled, str) else compiled
  out = []
  for comp, body in module.computations.items():
    times = module.times.get(comp, 0)
    for ins in body:
      kind = ins.opcode.removesuffix("-start")
      if kind not in KINDS or not times:
        continue
      if ins.opcode.endswith("-start"):
        raise ValueError(f"async {ins.opcode} is not counted by this parser (its result tuple holds the operand too)")
      elems = program_elements(module, ins) if program_dtypes else element_types(ins.type)
      size = sum(nbytes(d, dims) for d, dims in elems)
      if kind == "collective-permute":
        pairs = [_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", _PAIRS.search(ins.line).group(1))]
        moving = [(s, t) for s, t in pairs if s != t]
        out.append(Collective(kind, size * times, float(size * times) if moving else 0.0, 2,
                              any(s // devices_per_node != t // devices_per_node for s, t in moving), times,
                              ins.op_name))
        continue
      groups = replica_groups(ins.line, n_devices)
      n = len(groups[0])
      if kind == "reduce-scatter":
        size *= n
      factor = {"all-reduce": 2.0}.get(kind, 1.0) * (n - 1) / n
      inter = any(len({d // devices_per_node for d in g}) > 1 for g in groups)
      out.append(Collective(kind, size * times, factor * size * times, n, inter, times, ins.op_name))
  return out


def summarize(collectives: list[Collective], op_name_contains: str = "") -> dict[str, dict[str, float]]:
  """Per kind: count, buffer bytes, wire bytes within a node (NVLink) and across nodes (IB), per device.

  `op_name_contains` keeps only collectives whose source op name contains it (e.g. "ep_capacity").
  """
  out = {k: {"count": 0, "buffer_bytes": 0, "nvlink_bytes": 0.0, "ib_bytes": 0.0} for k in KINDS}
  for c in collectives:
    if op_name_contains not in c.op_name:
      continue
    s = out[c.kind]
    s["count"] += c.times
    s["buffer_bytes"] += c.buffer_bytes
    s["ib_bytes" if c.inter_node else "nvlink_bytes"] += c.wire_bytes
  return out
