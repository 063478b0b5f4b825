"""Shared helpers for `get_config(arg)` files (big_vision `configs/common.py` style)."""
from __future__ import annotations

import dataclasses
import typing

import ml_collections


def renamed(path: str, renames: dict[str, str]) -> str | None:
  """The line saying what the dotted `path` (a config key or an arg name) is now called, when a prefix of it is a
  key of `renames` (old prefix → new prefix); None when it was not renamed."""
  parts = path.split(".")
  for i in range(len(parts), 0, -1):
    old = ".".join(parts[:i])
    if old in renames:
      new = ".".join([renames[old], *parts[i:]])
      return f"{path} was renamed: it is now {new}"
  return None


def parse_arg(arg: str | None, *, lazy: bool = False, renames: dict[str, str] | None = None,
              **spec) -> ml_collections.ConfigDict:
  """Parses `"colab,steps=100"`-style config args into a ConfigDict typed by `spec`.

  A bare word sets the boolean of that name (`colab` → colab=True) or, when `variant` is in spec, the variant.
  Unknown names are an error that lists the valid ones, or names the new name of a renamed one.

  Args:
    arg: the string after ':' in `--config=file.py:arg` (None or "" for defaults).
    lazy: accept names not in `spec` (as strings).
    renames: old arg name → its new name.
    **spec: name → default value; its type casts the parsed value.
  """
  res = ml_collections.ConfigDict(spec)
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    if "=" in part:
      name, value = part.split("=", 1)
    elif "variant" in spec and part not in spec:
      name, value = "variant", part
    else:
      name, value = part, "True"
    if name not in spec and not lazy:
      moved = renamed(name, renames or {})
      raise ValueError(f"config arg {moved}" if moved else f"Unknown config arg {name!r} in {arg!r}; valid: "
                       f"{sorted(spec)}")
    default = spec.get(name, "")
    if isinstance(default, bool):
      if value not in ("True", "False", "true", "false", "1", "0"):
        raise ValueError(f"Config arg {name!r} expects a boolean, got {value!r}")
      res[name] = value in ("True", "true", "1")
    else:
      try:
        res[name] = type(default)(value)
      except ValueError:
        raise ValueError(f"Config arg {name!r} expects {type(default).__name__} (like {default!r}), got {value!r}"
                         ) from None
  return res


def override(c: ml_collections.ConfigDict, *overrides: dict) -> ml_collections.ConfigDict:
  """Sets each of `overrides` on `c` in turn: `{"a.b": v}`-style dotted keys, as `--config.a.b=v` does (a sweep
  row onto its variant), or nested sections (`{"a": {"b": v}}`).

  A key `c` does not have is an error naming it (a typo must not start a run with the default).
  """
  for group in overrides:
    for key, value in group.items():
      *path, leaf = key.split(".")
      node = c
      for i, p in enumerate(path):
        if p not in node:
          raise KeyError(f"{key!r}: the config has no {'.'.join(path[:i + 1])!r}")
        node = node[p]
      if leaf not in node:
        raise KeyError(f"{key!r}: the config has no {key!r}")
      if isinstance(value, dict) and isinstance(node[leaf], ml_collections.ConfigDict):
        override(node[leaf], value)
      else:
        node[leaf] = value
  return c


def defaults_of(cls, **given) -> ml_collections.ConfigDict:
  """Every field of the config dataclass `cls` at its default, nested dataclasses as sections: the keys a locked
  config accepts as `--config.<key>`, with the values the library would use. A `None` default becomes a typed
  placeholder (a flag can still set it); `given` sets fields (those without a default among them)."""
  hints = typing.get_type_hints(cls)
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(cls):
    if f.name in given:
      out[f.name] = given[f.name]
      continue
    if f.default is not dataclasses.MISSING:
      value = f.default
    elif f.default_factory is not dataclasses.MISSING:
      value = f.default_factory()
    else:
      continue   # required and not given (e.g. a workdir that comes by flag)
    if dataclasses.is_dataclass(value):
      out[f.name] = _values_of(value)
    elif value is None:
      arms = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
      out[f.name] = ml_collections.config_dict.placeholder(arms[0])
    else:
      out[f.name] = value
  return out


def _values_of(obj) -> ml_collections.ConfigDict:
  """`defaults_of` for a dataclass instance: its values, nested."""
  c = defaults_of(type(obj), **{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
                                if not dataclasses.is_dataclass(getattr(obj, f.name))
                                and getattr(obj, f.name) is not None})
  for f in dataclasses.fields(obj):
    v = getattr(obj, f.name)
    if dataclasses.is_dataclass(v):
      c[f.name] = _values_of(v)
  return c
