"""CPU stand-in for the one `sgl_kernel` op SGLang 0.5.23 calls on a plain CPU prefill/decode.

`sgl_kernel`'s CPU build is not on PyPI; SGLang's CPU path (`SGLANG_USE_CPU_ENGINE=1`) imports only
`assign_req_to_token_pool_cpu` from it. This is the same loop as SGLang's Triton kernel
`sglang.srt.mem_cache.allocation.assign_req_to_token_pool`, in plain torch. Test-time only.
"""

import torch

__version__ = "0.0.0+composer-jax-cpu-stub"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
  """Writes request i's new KV slots, out_cache_loc[sum(len_<i) : +len_i], into req_to_token[row_i, start_i:end_i]."""
  del pool_len  # rows of req_to_token already have this length
  starts, ends, rows = start_offset.tolist(), end_offset.tolist(), req_pool_indices.tolist()
  offset = 0
  for row, start, end in zip(rows, starts, ends, strict=True):
    n = end - start
    req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
    offset += n


def __getattr__(name: str):
  """Other CPU ops are imported at start-up but not called on a plain prefill/decode: fail only if one is called."""
  if name.startswith("__"):
    raise AttributeError(name)

  def missing(*args, **kwargs):
    raise NotImplementedError(f"sgl_kernel.{name} is not in the composer_jax CPU stand-in (rollout/engines/"
                              "sglang_patches/sgl_kernel): this SGLang feature is not supported on the CPU test path")

  missing.__name__ = name
  return missing
