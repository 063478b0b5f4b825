"""Shared by the SGLang tests: a tiny DeepSeek-V3 model exported with our HF exporter, and our own reference forward.

The reference is the trainer's forward (`composer_jax.model.forward`) on prompt + output: its log-softmax at position
P - 1 + t scores output token t, and its routing at P + t (output t as input) is what the client must report as
routed_experts[t] (-1 for the last output token, which is never fed back).
"""
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.interop import hf
from composer_jax.model import ModelConfig, forward
from composer_jax.model.params import ArrayInfo, param_specs

# MLA with q-LoRA, 1 dense + 2 MoE layers, sigmoid routing with bias, group-limited top-2 of 8, shared expert.
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, initializer_range=0.2,
                  max_position_embeddings=256)


def require_sglang():
  """Skips (with the install command) where the lean CPU SGLang is not installed."""
  for mod in ("sglang", "sglang_router"):
    if importlib.util.find_spec(mod) is None:
      pytest.skip(f"{mod} not installed: run `bash rollout/engines/install_sglang_cpu.sh .venv/bin/python`")


@functools.cache
def params(seed: int = 0) -> dict:
  """Random params with `init`'s structure, drawn in numpy (`init` re-jits per call: ~1 min on a loaded machine).

  Norm scales are ones, everything else N(0, initializer_range); the routing bias is non-zero so SGLang must apply
  it (selection uses score + bias, gate weights the score).
  """
  rng = np.random.default_rng(seed)
  specs = param_specs(CFG)

  def leaf(a):
    if "norm" in a.logical_axes:
      return jnp.ones(a.shape, a.dtype)
    return jnp.asarray(CFG.initializer_range * rng.standard_normal(a.shape), a.dtype)

  p = jax.tree.map(leaf, specs, is_leaf=lambda x: isinstance(x, ArrayInfo))
  bias = p["moe_layers"]["moe"]["bias"]
  p["moe_layers"]["moe"]["bias"] = jnp.asarray(0.1 * rng.standard_normal(bias.shape), bias.dtype)
  return p


def save_checkpoint(path: str, seed: int = 0) -> str:
  hf.save(path, CFG, params(seed))
  return path


@functools.partial(jax.jit, static_argnames=())
def _forward(p, tokens_BxL):
  logits_BxLxV, aux = forward(p, tokens_BxL, CFG)
  return jax.nn.log_softmax(logits_BxLxV, -1), aux["experts"]


def reference(seed: int, prompt: tuple[int, ...], output: np.ndarray):
  """Our forward on prompt + output[:-1]: (greedy_T, logprob_T of `output`, experts int32 [T, N, K])."""
  P, T = len(prompt), len(output)
  seq = np.asarray(prompt + tuple(int(t) for t in output[:-1]), np.int32)
  logp_LxV, experts_NxLxK = _forward(params(seed), jnp.asarray(seq[None]))
  logp = np.asarray(logp_LxV[0, P - 1:P - 1 + T])
  experts_TxNxK = np.full((T, experts_NxLxK.shape[0], experts_NxLxK.shape[-1]), -1, np.int32)
  experts_TxNxK[:T - 1] = np.asarray(experts_NxLxK[:, 0, P:P + T - 1]).transpose(1, 0, 2)
  return logp.argmax(-1), logp[np.arange(T), output], experts_TxNxK, logp


def prompt_experts(seed: int, prompt: tuple[int, ...]) -> np.ndarray:
  """Our forward's routing of the prompt tokens as inputs, int32 [P, N, K] (what prompt_routed_experts must be)."""
  _, experts_NxLxK = _forward(params(seed), jnp.asarray(np.asarray(prompt, np.int32)[None]))
  return np.asarray(experts_NxLxK[:, 0]).transpose(1, 0, 2)


def routing_agreement(a_TxNxK: np.ndarray, b_TxNxK: np.ndarray) -> float:
  """Fraction of (token, layer) whose expert *sets* agree (engines may list the top-k in different orders)."""
  return float((np.sort(a_TxNxK, -1) == np.sort(b_TxNxK, -1)).all(-1).mean())
