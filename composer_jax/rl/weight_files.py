"""Weight publishing from the trainer to rollout workers: one `.npz` per policy version plus an atomic pointer.

`weights/v<version>.npz` holds the params flattened by tree path; `weights/latest.json` names the newest. Both are
written to a temp name and renamed, so a reader never sees half a file. Workers poll `latest()` between groups.

A trainer killed during a publish leaves the pointer on the previous version (workers keep serving it) and a temp
file; one killed after a publish but before that step's checkpoint has published versions its restart will redo
with other weights. `recover(directory, version)`, run when the trainer (re)starts at checkpoint `version`, deletes
both, so every version number names one set of weights: the redone version is published once, and workers that
loaded a withdrawn one go back to `version` (they follow the pointer, not "newer").
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np


def _flat(params) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in leaves}


def publish(directory: str, params, version: int, keep: int = 3) -> str:
  """Writes `params` as policy `version` and points `latest.json` at it; keeps the newest `keep` files."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"v{version}.npz")
  tmp = path + ".tmp.npz"
  np.savez(tmp, **_flat(params))
  os.replace(tmp, path)
  _point(directory, version, path)
  old = sorted(int(n[1:-4]) for n in os.listdir(directory) if n.startswith("v") and n.endswith(".npz")
                and ".tmp" not in n)
  for v in old[:-keep]:
    if v != version:
      os.remove(os.path.join(directory, f"v{v}.npz"))
  return path


def publish_unless_latest(directory: str, params, version: int) -> None:
  """`publish` unless `version` is already the one `latest.json` names (a resumed trainer's first version, the
  final policy a publisher has already written)."""
  got = latest(directory)
  if got is None or got[0] != version:
    publish(directory, params, version)


def recover(directory: str, version: int) -> list[int]:
  """Deletes temp files of a killed publish and versions newer than `version` (the checkpoint the trainer resumes
  from); re-points `latest.json` at `version` if it named a deleted one. Returns the deleted versions."""
  if not os.path.isdir(directory):
    return []
  for name in os.listdir(directory):
    if ".tmp" in name:
      os.remove(os.path.join(directory, name))
  withdrawn = sorted(int(n[1:-4]) for n in os.listdir(directory)
                     if n.startswith("v") and n.endswith(".npz") and int(n[1:-4]) > version)
  got = latest(directory)
  if got is not None and got[0] > version:   # the pointer moves first: a reader never finds it naming a gone file
    if os.path.exists(os.path.join(directory, f"v{version}.npz")):
      _point(directory, version, os.path.join(directory, f"v{version}.npz"))
    else:
      os.remove(os.path.join(directory, "latest.json"))
  for v in withdrawn:
    os.remove(os.path.join(directory, f"v{v}.npz"))
  return withdrawn


def _point(directory: str, version: int, path: str) -> None:
  """Atomically makes `latest.json` name `path` as `version`."""
  ptr_tmp = os.path.join(directory, "latest.json.tmp")
  with open(ptr_tmp, "w") as f:
    json.dump({"version": version, "path": os.path.basename(path)}, f)
  os.replace(ptr_tmp, os.path.join(directory, "latest.json"))


def latest(directory: str) -> tuple[int, str] | None:
  """(version, path) of the newest published weights, or None if nothing is published yet."""
  ptr = os.path.join(directory, "latest.json")
  if not os.path.exists(ptr):
    return None
  with open(ptr) as f:
    d = json.load(f)
  return int(d["version"]), os.path.join(directory, d["path"])


def load(path: str, like):
  """Params shaped like `like` (a pytree of arrays or ShapeDtypeStructs) from a published `.npz`."""
  with np.load(path) as z:
    flat = dict(z)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  out = []
  for p, x in leaves:
    k = jax.tree_util.keystr(p)
    if k not in flat:
      raise ValueError(f"{path} has no leaf {k}; was it published from a different model config?")
    if flat[k].shape != tuple(x.shape):
      raise ValueError(f"{path}: leaf {k} has shape {flat[k].shape}, expected {tuple(x.shape)}")
    out.append(flat[k])
  return jax.tree_util.tree_unflatten(treedef, out)
