"""Test-time patches that let SGLang 0.5.23 serve DeepSeek-V3 (MLA + MoE) on CPU with routing logs.

Put this directory on PYTHONPATH of the server process (the launcher does); Python runs `sitecustomize` at start-up
in the server and in every scheduler/detokenizer process it spawns. It patches two modules right after they are
imported (written against sglang==0.5.23; other versions are refused loudly):

1. `--enable-return-routed-experts` allocates its host buffer with `ALLOC_MEMORY_FUNCS[device]`, whose default
   registers pinned memory with CUDA. On CPU a plain allocation is the right thing.
2. The DeepSeek attention-backend registry has no `torch_native` entry; the fallback (the Triton handler) picks the
   non-absorbed MHA prefill path, which crashes on the MLA latent cache. On CPU, always use absorbed MLA.

The sibling packages `sgl_kernel` (one CPU op in plain torch) and `torchvision` (an import stub) are on the same path.
"""

import importlib.abc
import importlib.machinery
import os
import sys

PINNED_SGLANG = "0.5.23"


def _patch_host_alloc(module):
  import torch

  def alloc_plain(dims, dtype, device, pin_memory=False, allocator=None, **kwargs):
    del pin_memory, allocator, kwargs  # pinning needs CUDA; the buffer stays on the host either way
    return torch.empty(dims, dtype=dtype, device=device)

  module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_plain


def _patch_mla_registry(module):
  from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

  module.AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)


_PATCHES = {
  "sglang.srt.mem_cache.pool_host.common": _patch_host_alloc,
  "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_mla_registry,
}


def _check_version():
  from importlib.metadata import version

  found = version("sglang")
  if found != PINNED_SGLANG and not os.environ.get("COMPOSER_JAX_SGLANG_ANY_VERSION"):
    raise RuntimeError(f"rollout/engines/sglang_patches were written against sglang=={PINNED_SGLANG}, found {found}; "
                       "re-check the patches and update PINNED_SGLANG (or set COMPOSER_JAX_SGLANG_ANY_VERSION=1)")


class _PatchingLoader(importlib.abc.Loader):
  def __init__(self, inner, patch):
    self.inner, self.patch = inner, patch

  def create_module(self, spec):
    return self.inner.create_module(spec)

  def exec_module(self, module):
    self.inner.exec_module(module)
    self.patch(module)


class _PatchFinder(importlib.abc.MetaPathFinder):
  """Finds the patched modules with the normal path finder and runs their patch after they execute."""

  def find_spec(self, fullname, path=None, target=None):
    patch = _PATCHES.get(fullname)
    if patch is None:
      return None
    _check_version()
    spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
    if spec is not None and spec.loader is not None:
      spec.loader = _PatchingLoader(spec.loader, patch)
    return spec


sys.meta_path.insert(0, _PatchFinder())
