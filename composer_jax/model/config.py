"""Frozen model configuration: the one object library code takes.

Field names follow Hugging Face's `DeepseekV3Config` so that interop is a rename-free copy. Built once from the
ml-collections ConfigDict in `experiments/` with `composer_jax.configs.from_dict(ModelConfig, cfg.model)`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """YaRN parameters, as in HF `rope_scaling` ({"type": "yarn", ...})."""
  factor: float = 1.0
  original_max_position_embeddings: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0
  type: str = "yarn"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A DeepSeek-V3 / Kimi-K2 family MoE transformer."""
  vocab_size: int = 512
  hidden_size: int = 64
  intermediate_size: int = 128            # dense MLP layers (the first `first_k_dense_replace`)
  moe_intermediate_size: int = 32         # each routed / shared expert
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  # MLA
  q_lora_rank: int | None = None          # None: full-rank query projection
  kv_lora_rank: int = 32
  qk_nope_head_dim: int = 16
  qk_rope_head_dim: int = 8
  v_head_dim: int = 16
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rope_interleave: bool = True            # DeepSeek's rope layout: rotate pairs (x0, x1), (x2, x3), ... (HF default)
  max_position_embeddings: int = 4096
  attention_impl: str = "dense"           # "dense" | "ring" | "allgather": the last two shard the sequence on the
                                          # mesh's `context` axis (model/context_parallel.py; needs `jax.set_mesh`)
  attention_kernel: str = "auto"          # self-attention: "whole" | "tiled" | "pallas" (GPU) | "auto" (by platform:
                                          # attention.AUTO_ATTENTION_KERNEL; how it was chosen: model/README.md)
  attention_block: int = 64               # tile size (queries and keys) of the tiled single-device attend
  ring_block: int = 512                   # tile size inside each ring / all-gather attention block
  rms_norm_eps: float = 1e-6
  # MoE
  n_routed_experts: int = 8
  n_shared_experts: int = 1
  num_experts_per_tok: int = 2
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  first_k_dense_replace: int = 1
  moe_layer_freq: int = 1
  seq_aux_loss_coef: float = 0.0          # sequence-level balance loss weight (0: aux-loss-free only)
  moe_impl: str = "auto"                  # a name in model.moe.MOE_IMPLS: "dense" | "blocked" | "ragged" |
                                          # "capacity" | "ep_capacity" | "ep_ragged" (EP: a mesh), "auto" (by platform)
  capacity_factor: float = 1.25           # for moe_impl="capacity" / "ep_capacity"
  ragged_buffer_factor: float = 0.0       # ep_ragged's receive buffer: 0 = the worst case (N x local assignments,
                                          # never drops), f > 0 = f x local assignments (overflow cut and counted)
  ep_dispatch: str = "compute"            # ep_capacity's token exchange: "compute" (the compute dtype) | "fp8"
                                          # (e4m3 with a per-slot scale out; the return and gradients stay in the
                                          # compute dtype, as DeepSeek-V3 dispatches)
  moe_matmul: str = "bf16"                # ragged expert matmuls: "bf16" (compute dtype) | "mxfp8" | "nvfp4"
  moe_scale: str = "per_token"            # NVFP4 second-level scale: "per_token" | "per_tensor"
  # MTP (DeepSeek-V3 NextN)
  num_nextn_predict_layers: int = 0
  # numerics / structure
  tie_word_embeddings: bool = False
  initializer_range: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  scan_layers: bool | None = None         # lax.scan over each stack of identical layers (True), a Python loop
                                          # (False), or None: by platform (`transformer.scans_layers`)
  remat: bool = False
  remat_policy: str = "full"              # with remat: a name in model.remat.REMAT_POLICIES — "full" (save
                                          # only each layer's input), "save_dots" (keep matmul outputs),
                                          # "save_attention" (the ring's output), "save_attention_ep_return"

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  def is_moe_layer(self, i: int) -> bool:
    return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0
