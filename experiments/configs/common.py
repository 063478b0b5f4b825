"""Shared helpers for `get_config(arg)` files (big_vision `configs/common.py` style)."""
from __future__ import annotations

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


def override(c: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """Sets `{"a.b": v}`-style dotted keys on `c`, as `--config.a.b=v` does (a sweep row onto its variant).

  A key `c` does not have is an error naming it (a typo must not start a run with the default).
  """
  for key, value in overrides.items():
    *path, leaf = key.split(".")
    node = c
    for i, p in enumerate(path):
      if p not in node:
        raise KeyError(f"{key!r}: the config has no {'.'.join(path[:i + 1])!r}")
      node = node[p]
    if leaf not in node:
      raise KeyError(f"{key!r}: the config has no {key!r}")
    node[leaf] = value
  return c
