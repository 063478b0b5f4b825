"""Collectives of a compiled (per-device, SPMD-partitioned) HLO module: kind, bytes, group size, intra/inter node.

Used by `scale_plan.py`. Two texts go in:
- the compiled module (`compiled.as_text()`): the program that runs, after every pass (fusion, DCE, combiners);
- the module right after SPMD partitioning (dumped by XLA, see `dump_flags`): it has the program's own element
  types. XLA:CPU's `float-normalization-bf16` pass later upcasts every bf16 collective to f32 (the CPU runtime has
  no bf16 reductions); a GPU keeps bf16 (NCCL reduces bf16). Collectives keep their `channel_id` through the
  passes, so each compiled collective's bytes are counted in the element type it had after partitioning.

Bytes per device are the size of the buffer the op produces (for `reduce-scatter`: its input, the group size times
its result) and the bytes a device sends over the wire under the usual ring / pairwise algorithms, for a group of n:
all-gather, reduce-scatter, all-to-all: (n-1)/n x buffer; all-reduce: 2 (n-1)/n x buffer; collective-permute: the
buffer, unless the pair is a device to itself (sent nowhere).
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import re

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (" + "|".join(KINDS) + r")(-start)?\(")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_CHANNEL = re.compile(r"channel_id=(\d+)")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                          r"\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")

BITS = {"pred": 8, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f4e2m1fn": 4, "bf16": 16, "f16": 16, "s16": 16,
        "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64}


def dump_flags(directory: str) -> str:
  """XLA_FLAGS that make XLA write each module right after SPMD partitioning into `directory`."""
  return f"--xla_dump_to={directory} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=spmd-partitioning"


def partitioned_text(directory: str, module_name: str) -> str:
  """The newest dumped `after_spmd-partitioning` text of the module named `module_name` (e.g. jit_train_step)."""
  files = glob.glob(os.path.join(directory, f"module_*.{module_name}.*after_spmd-partitioning*.txt"))
  if not files:
    raise FileNotFoundError(f"no after_spmd-partitioning dump of {module_name} in {directory}; was XLA_FLAGS "
                            f"{dump_flags(directory)!r} set before jax was imported?")
  with open(max(files, key=os.path.getmtime)) as f:
    return f.read()


def _element_types(result_type: str) -> list[tuple[str, tuple[int, ...]]]:
  out = []
  for dtype, dims in _SHAPE.findall(result_type):
    if dtype not in BITS:
      raise ValueError(f"unknown HLO element type {dtype!r} in a collective's result {result_type!r}; add it to BITS")
    out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
  return out


def program_dtypes(partitioned: str) -> dict[int, list[str]]:
  """channel_id -> element types of the collective's result(s), as the program has them (before CPU upcasts)."""
  out = {}
  for line in partitioned.splitlines():
    m = _OP.match(line)
    c = _CHANNEL.search(line)
    if m and c:
      out[int(c.group(1))] = [d for d, _ in _element_types(m.group(1))]
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


_COMP_START = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _weighted_lines(module: str):
  """Yields (instruction line, times it runs per execution of the module), following while loops' trip counts."""
  comps, entry, cur = {}, None, None
  for line in module.splitlines():
    if cur is None:
      m = _COMP_START.match(line)
      if m:
        cur = m.group(2)
        comps[cur] = []
        entry = cur if m.group(1) else entry
    elif line.strip() == "}":
      cur = None
    else:
      comps[cur].append(line)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  times: dict[str, int] = {}

  def visit(name: str, mult: int, depth: int = 0):
    if depth > 100:
      raise ValueError(f"HLO call graph deeper than 100 at {name}")
    times[name] = times.get(name, 0) + mult
    for line in comps.get(name, []):
      callees = _CALLEE.findall(line)
      if b := _BRANCHES.search(line):
        callees += [c.strip().lstrip("%") for c in b.group(1).split(",")]
      if " while(" in line:
        trip = _TRIP.search(line)
        if trip is None:
          raise ValueError(f"a while loop without a known trip count: {line[:200]}")
        body = re.search(r"\bbody=%([\w.\-]+)", line).group(1)
        visit(body, mult * int(trip.group(1)), depth + 1)
        callees = [c for c in callees if c != body]
      for c in callees:
        if c in comps:
          visit(c, mult, depth + 1)
  visit(entry, 1)
  for name, lines in comps.items():
    for line in lines:
      if name in times:
        yield line, times[name]


@dataclasses.dataclass
class Collective:
  kind: str
  buffer_bytes: int      # per device: the op's result (reduce-scatter: its input)
  wire_bytes: float      # per device, sent over links (ring / pairwise algorithms)
  group_size: int
  inter_node: bool       # some group spans more than one node
  times: int = 1         # executions per step (trip counts of enclosing while loops); bytes above include it
  op_name: str = ""      # the JAX op it came from (metadata): `.../shard_map/...` is ours, else the partitioner's


def parse(compiled: str, dtypes: dict[int, list[str]] | None, n_devices: int, devices_per_node: int = 8
          ) -> list[Collective]:
  """Every collective of the compiled per-device module, its bytes counted in the program's element types.

  A collective inside a `while` body is counted once per iteration (the loop's known trip count; a loop without
  one is an error).
  """
  out = []
  for line, times in _weighted_lines(compiled):
    m = _OP.match(line)
    if not m:
      continue
    kind, is_async = m.group(2), m.group(3)
    if is_async:
      raise ValueError(f"async {kind}-start is not counted by this parser (its result tuple holds the operand too)")
    elems = _element_types(m.group(1))
    c = _CHANNEL.search(line)
    if dtypes is not None and c and int(c.group(1)) in dtypes and len(dtypes[int(c.group(1))]) == len(elems):
      elems = [(d, dims) for d, (_, dims) in zip(dtypes[int(c.group(1))], elems)]
    nbytes = sum(math.prod(dims) * BITS[d] // 8 for d, dims in elems)
    name_match = _OP_NAME.search(line)
    op_name = name_match.group(1) if name_match else ""
    if kind == "collective-permute":
      pairs = [_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", _PAIRS.search(line).group(1))]
      moving = [(s, t) for s, t in pairs if s != t]
      out.append(Collective(kind, nbytes * times, float(nbytes * times) if moving else 0.0, 2,
                            any(s // devices_per_node != t // devices_per_node for s, t in moving), times,
                            op_name))
      continue
    groups = replica_groups(line, n_devices)
    n = len(groups[0])
    if kind == "reduce-scatter":
      nbytes *= n
    factor = {"all-reduce": 2.0}.get(kind, 1.0) * (n - 1) / n
    inter = any(len({d // devices_per_node for d in g}) > 1 for g in groups)
    out.append(Collective(kind, nbytes * times, factor * nbytes * times, n, inter, times, op_name))
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
