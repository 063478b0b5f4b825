r"""What a 1T-parameter Kimi K2 checkpoint needs per host with sliced loading (`interop.hf.load`) on a chosen mesh.

  python benchmarks/checkpoint_host_memory.py [--variant kimi_k2] [--hosts 32] [--devices_per_host 8] \
      [--mesh expert=32,tensor=8] [--fsdp 1]

Arithmetic only, nothing is materialised: the param shapes come from `jax.eval_shape` (experiments/configs/model.py's
variant), their PartitionSpecs from the run's `ShardingRules` on an abstract mesh, and hosts own consecutive devices
in mesh order (as `make_mesh` lays out `jax.devices()`, process by process). For each host it sums the distinct
blocks its devices hold — exactly what `load` reads and places on that host — in the param dtype, and what is read
from disk for the published block-FP8 checkpoint (linears 1 byte + float32 scale per 128 x 128 block, the rest in
the param dtype). `largest_leaf_per_host` bounds the transient host memory of loading: `load` builds one leaf at a
time (its host blocks, then onto the devices). The last line is JSON.
"""
import argparse
import json
import math

import jax
import numpy as np
from jax.sharding import AbstractMesh

from composer_jax import configs
from composer_jax.interop import fp8 as fp8_lib
from composer_jax.interop.hf_names import leaf_paths, sources
from composer_jax.model import ModelConfig, abstract_params, count_params, shardings
from composer_jax.parallel.mesh import MESH_AXES, MeshConfig
from experiments.configs import model as model_configs

GB = 1e9


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def host_blocks(spec, shape, sizes: dict[str, int], hosts: int) -> list[tuple[int, int]]:
  """Per host: (distinct blocks its devices hold, elements per block) of one leaf."""
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  coords = np.stack(np.unravel_index(np.arange(math.prod(sizes.values())), [sizes[a] for a in MESH_AXES]), -1)
  per_host = len(coords) // hosts
  shards = [math.prod(sizes[a] for a in _axes(s)) for s in spec]
  block_elems = math.prod(n // k for n, k in zip(shape, shards))
  out = []
  for h in range(hosts):
    mine = coords[h * per_host:(h + 1) * per_host]
    keys = set()
    for c in mine:
      at = dict(zip(MESH_AXES, c))
      keys.add(tuple(int(np.ravel_multi_index([at[a] for a in _axes(s)], [sizes[a] for a in _axes(s)]))
                     if _axes(s) else 0 for s in spec))
    out.append((len(keys), block_elems))
  return out


def per_host(cfg: ModelConfig, sizes: dict[str, int], hosts: int, rules) -> dict:
  mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
  avals, specs, srcs = leaf_paths(abstract_params(cfg)), leaf_paths(shardings(cfg, mesh, rules)), sources(cfg)
  mem, disk = np.zeros(hosts), np.zeros(hosts)
  largest = np.zeros(hosts)
  for path, aval in avals.items():
    src = srcs[path]
    fp8 = fp8_lib.is_quantisable(src.name((0,) * src.n_stack))
    for h, (n, elems) in enumerate(host_blocks(specs[path].spec, aval.shape, sizes, hosts)):
      b = n * elems * aval.dtype.itemsize
      mem[h] += b
      largest[h] = max(largest[h], b)
      disk[h] += n * elems * (1 + 4 / 128**2) if fp8 else b
  return {"mem": mem, "disk": disk, "largest": largest}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="kimi_k2")
  ap.add_argument("--hosts", type=int, default=32)
  ap.add_argument("--devices_per_host", type=int, default=8)
  ap.add_argument("--mesh", default="expert=32,tensor=8", help="axis=size,... over hosts x devices_per_host")
  ap.add_argument("--fsdp", type=int, default=1)
  args = ap.parse_args()
  cfg = configs.from_dict(ModelConfig, model_configs.get_config(args.variant).to_dict())
  sizes = dict.fromkeys(MESH_AXES, 1)
  sizes.update({k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))})
  n_dev = args.hosts * args.devices_per_host
  if math.prod(sizes.values()) != n_dev:
    raise SystemExit(f"mesh {sizes} has {math.prod(sizes.values())} devices, not hosts x devices_per_host = {n_dev}")
  rules = MeshConfig(**{a: sizes[a] for a in MESH_AXES}, fsdp=bool(args.fsdp)).rules()
  total, _ = count_params(cfg)
  full = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(abstract_params(cfg)))
  r = per_host(cfg, sizes, args.hosts, rules)
  print(f"{args.variant}: {total / 1e12:.3f}T params, {full / GB:.0f} GB in {cfg.param_dtype}; mesh {sizes} on "
        f"{args.hosts} hosts x {args.devices_per_host} devices")
  print(f"  full copy on every host (before): {full / GB:.0f} GB per host")
  print(f"  sliced, per host: params {r['mem'].max() / GB:.1f} GB (min {r['mem'].min() / GB:.1f}), read from the "
        f"block-FP8 checkpoint {r['disk'].max() / GB:.1f} GB, largest single leaf {r['largest'].max() / GB:.1f} GB")
  print(f"  per device: {r['mem'].max() / args.devices_per_host / GB:.1f} GB of params (no replication within a host)")
  print(json.dumps({"variant": args.variant, "mesh": sizes, "hosts": args.hosts,
                    "devices_per_host": args.devices_per_host, "total_params": total,
                    "full_copy_gb_per_host": round(full / GB, 1),
                    "sliced_params_gb_per_host": round(float(r["mem"].max()) / GB, 1),
                    "sliced_fp8_read_gb_per_host": round(float(r["disk"].max()) / GB, 1),
                    "largest_leaf_gb_per_host": round(float(r["largest"].max()) / GB, 1)}))


if __name__ == "__main__":
  main()
