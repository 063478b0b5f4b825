"""Named remat policies for each layer of a stack (`ModelConfig.remat_policy`, with `remat=True`), as MaxText names
its `remat_policy` trade-offs; `transformer.run_stack` wraps each layer in `jax.checkpoint(policy=...)`.

- "full": recompute the whole layer in the backward (least memory).
- "save_dots": keep the outputs of matmuls without batch dims (recompute only the cheap elementwise ops).
- "save_attention": keep the context-parallel attention's output and log-sum-exp (ring_attention.py names them),
  so the ring does not run again in the backward: per layer [B, L, H, Dv] plus [B, H, L] float32 per device.
- "save_attention_ep_return": also keep the expert-parallel return exchange's result (expert_parallel.py names it;
  [t x K, D] per device per layer: each token's chosen experts' output rows), so the backward re-runs only the
  dispatch exchange.
- "offload_layer_input": the layer's input (`LAYER_INPUT`, named by `run_stack`) is moved to pinned host memory
  after the forward and back before the backward; everything else is recomputed. Device memory then holds no
  per-layer activations at all. Only where host memory is a separate space (GPU, TPU): on XLA:CPU jax emits no
  transfer, so the policy is refused there (`offload_layer_input` raises) rather than silently keeping the inputs
  on the device.
"""
from __future__ import annotations

import jax

from composer_jax.model.config import ModelConfig

LAYER_INPUT = "layer_input"
# Platforms whose devices have a host memory space apart from their own (jax's `pinned_host` memory kind).
HOST_MEMORY_PLATFORMS = ("cuda", "rocm", "tpu")


def offload_layer_input(platform: str | None = None):
  """The offloading policy; `platform` defaults to jax's default backend.

  Raises:
    ValueError: on a platform without a separate host memory space.
  """
  platform = platform or jax.default_backend()
  if platform not in HOST_MEMORY_PLATFORMS:
    raise ValueError(f"remat_policy='offload_layer_input' moves layer inputs to host memory, which platform "
                     f"{platform!r} does not have apart from its device memory (jax emits no transfer there); "
                     f"use it on {', '.join(HOST_MEMORY_PLATFORMS)}, or pick another policy: {sorted(REMAT_POLICIES)}")
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT], offload_src="device",
      offload_dst="pinned_host")


REMAT_POLICIES = {
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    "save_dots": lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention": lambda: jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse"),
    "save_attention_ep_return": lambda: jax.checkpoint_policies.save_only_these_names(
        "attention_out", "attention_lse", "ep_return"),
    "offload_layer_input": offload_layer_input,
}


def remat_policy(cfg: ModelConfig):
  """The `jax.checkpoint` policy `cfg.remat_policy` names, or a ValueError listing the valid names."""
  if cfg.remat_policy not in REMAT_POLICIES:
    raise ValueError(f"remat_policy={cfg.remat_policy!r}; valid: {sorted(REMAT_POLICIES)}")
  return REMAT_POLICIES[cfg.remat_policy]()
