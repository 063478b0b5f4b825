"""Shared by the sliced-loading tests: a small checkpoint, each process's share of it, and (as a script) one process
of a multi-process load + save:

  python tests/hf_sliced_testlib.py CKPT FP8_CKPT OUT COORDINATOR NUM_PROCESSES PROCESS_ID

Each process loads both checkpoints on a mesh (expert=2, tensor=2) spanning the processes, writes what it read and
its share (`OUT/process_<i>.json`) and its local blocks (`OUT/blocks_<i>.npz`); all then save the plain one together
into `OUT/saved` (each process writes its own experts, no gathering), and once more from an FSDP mesh (data=2,
tensor=2: weights split across the processes, so tensors are gathered) into `OUT/saved_fsdp`.
"""
import json
import math
import os
import sys

if __name__ == "__main__":   # join the run before any import touches a device (jax.distributed needs that)
  from composer_jax.parallel import distributed
  _coordinator, _n, _i = sys.argv[4:7]
  distributed.initialize(distributed.DistributedConfig(coordinator_address=_coordinator, num_processes=int(_n),
                                                       process_id=int(_i)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from composer_jax.interop import fp8 as fp8_lib  # noqa: E402
from composer_jax.interop import hf  # noqa: E402
from composer_jax.interop.hf_names import leaf_paths, sources  # noqa: E402
from composer_jax.model import ModelConfig  # noqa: E402

# Every sharded dim divisible by data/expert/tensor up to 2 (heads 2, experts 4, D 32, vocab 80, ffw 48/16).
CFG = ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, initializer_range=0.1, max_position_embeddings=64, num_nextn_predict_layers=1)
MESH = {"expert": 2, "tensor": 2}
FSDP_MESH = {"data": 2, "tensor": 2}


def share_bytes(cfg: ModelConfig, params: dict, fp8: bool = False) -> dict[str, int]:
  """Bytes of the distinct blocks this process's devices hold, as stored (FP8 linears 1 byte, else 4), per kind."""
  srcs, out = sources(cfg), {"experts": 0, "other": 0}
  for path, x in leaf_paths(params).items():
    blocks = {tuple((s.start, s.stop) for s in shard.index) for shard in x.addressable_shards}
    src = srcs[path]
    stored = 1 if fp8 and fp8_lib.is_quantisable(src.name((0,) * src.n_stack)) else 4
    n = sum(math.prod((b if b is not None else x.shape[d]) - (a or 0) for d, (a, b) in enumerate(blk))
            for blk in blocks)
    out["experts" if src.n_stack == 2 else "other"] += n * stored
  return out


def local_blocks(params: dict) -> dict[str, np.ndarray]:
  """{"<leaf>|<start:stop,...>": block} for this process's distinct blocks."""
  out = {}
  for path, x in leaf_paths(params).items():
    for shard in x.addressable_shards:
      key = "/".join(path) + "|" + ",".join(f"{s.start}:{s.stop}" for s in shard.index)
      out[key] = np.asarray(shard.data)
  return out


def gathered(cfg, params) -> int:
  """How many hub tensors `save` must gather (no process holds them whole)."""
  from composer_jax.interop import hf_save
  from composer_jax.interop.hf_names import hub_tensors
  return sum(w is None for w in hf_save._writers(hub_tensors(cfg), leaf_paths(params), jax.process_count()).values())


def main(ckpt, fp8_ckpt, out, coordinator, n, i):
  del coordinator   # joined at import
  from composer_jax.parallel.mesh import make_mesh
  mesh = make_mesh(MESH)
  record = {"devices": jax.device_count()}
  blocks = {}
  for kind, path in (("plain", ckpt), ("fp8", fp8_ckpt)):
    cfg, params, stats = hf.load_with_stats(path, mesh=mesh)
    record[kind] = {"bytes_read": stats.bytes_read, "share": share_bytes(cfg, params, fp8=kind == "fp8")}
    blocks.update({f"{kind}|{k}": v for k, v in local_blocks(params).items()})
    if kind == "plain":
      record["wrote"] = hf.save(os.path.join(out, "saved"), cfg, params, max_shard_bytes=40_000)
      record["gathered"] = gathered(cfg, params)
  cfg, params = hf.load(ckpt, mesh=make_mesh(FSDP_MESH))
  record["wrote_fsdp"] = hf.save(os.path.join(out, "saved_fsdp"), cfg, params, max_shard_bytes=40_000)
  record["gathered_fsdp"] = gathered(cfg, params)
  os.makedirs(out, exist_ok=True)
  np.savez(os.path.join(out, f"blocks_{i}.npz"), **blocks)
  with open(os.path.join(out, f"process_{i}.json"), "w") as f:
    json.dump(record, f)
  print(f"process {i}/{n}: done", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
