"""The one ConfigDict → frozen dataclass converter (library code takes dataclasses; `experiments/` keeps ConfigDicts).

`from_dict(cls, d)` builds `cls` from a nested mapping (an `ml_collections.ConfigDict`, its `to_dict()`, or a plain
dict) whose keys mirror the dataclass fields: a field typed as a dataclass takes a nested mapping (or `None` when
the type allows it), a `tuple[...]` field takes a list or tuple. An unknown key is an error that names it with its
full path and lists the valid keys, so a typo in a config file or on the command line fails loudly.

  cfg = from_dict(RunConfig, config)                        # whole config file
  cfg = from_dict(RunConfig, config, workdir="runs/x")      # plus fields the file does not hold
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

T = typing.TypeVar("T")


def _as_mapping(d) -> Mapping | None:
  if hasattr(d, "to_dict") and not dataclasses.is_dataclass(d):   # an ml_collections ConfigDict
    return d.to_dict()
  return d if isinstance(d, Mapping) else None


@functools.cache
def _field_types(cls) -> dict[str, Any]:
  hints = typing.get_type_hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def from_dict(cls: type[T], d, path: str = "", **extra) -> T:
  """`cls` from the nested mapping `d` (plus `extra` top-level fields); unknown keys name themselves.

  Args:
    cls: a dataclass type.
    d: a ConfigDict, a dict, or already a `cls` (returned as is when there are no `extra` fields).
    path: the dotted prefix of `d` in the whole config, for error messages.
    **extra: fields set beside those of `d` (e.g. a workdir given by flag).
  """
  if isinstance(d, cls) and not extra:
    return d
  m = _as_mapping(dataclasses.asdict(d) if isinstance(d, cls) else d)
  if m is None:
    raise TypeError(f"config {path or cls.__name__!r} must be a mapping for {cls.__name__}, got {type(d).__name__}")
  m = {**m, **extra}
  types_ = _field_types(cls)
  unknown = sorted(set(m) - set(types_))
  if unknown:
    where = ", ".join(f"{path}{k}" for k in unknown)
    raise ValueError(f"unknown config key(s) {where} for {cls.__name__}; valid keys: {sorted(types_)}")
  return cls(**{k: _convert(types_[k], v, f"{path}{k}") for k, v in m.items()})


def _convert(tp, v, path: str):
  """`v` as a value of type `tp`: dataclasses from mappings, tuples from lists; anything else unchanged."""
  if v is None:
    return None
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    arms = [a for a in typing.get_args(tp) if a is not type(None)]
    if _as_mapping(v) is not None:
      for a in arms:
        if dataclasses.is_dataclass(a):
          return from_dict(a, v, path + ".")
    return _convert(arms[0], v, path) if len(arms) == 1 else v
  if dataclasses.is_dataclass(tp) and not dataclasses.is_dataclass(v):
    return from_dict(tp, v, path + ".")
  if origin is tuple and isinstance(v, list | tuple):
    args = typing.get_args(tp)
    elem = args[0] if len(args) == 2 and args[1] is Ellipsis else None
    return tuple(_convert(elem, x, f"{path}[{i}]") if elem is not None else x for i, x in enumerate(v))
  return v


def to_dict(cfg) -> dict:
  """The nested plain-dict form of a config dataclass (the inverse of `from_dict`)."""
  return dataclasses.asdict(cfg)


def replace(cfg: T, **overrides) -> T:
  """`cfg` with dotted-path overrides (`replace(cfg, **{"rl.loss.kl_coef": 0.0})`), checked like `from_dict`."""
  d = to_dict(cfg)
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = d
    for p in parents:
      if not isinstance(node.get(p), dict):
        raise ValueError(f"config override {key!r}: {p!r} is not a section of {type(cfg).__name__}")
      node = node[p]
    node[leaf] = value
  return from_dict(type(cfg), d)
