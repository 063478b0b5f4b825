"""The decoder: embeddings, scanned dense and MoE layer stacks, final norm, LM head, MTP modules.

Letters: B batch, L length, D hidden, V vocab, E routed experts, K experts per token, Nm MTP modules,
Lm MoE layers (trunk).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from composer_jax.model import context_parallel as cp_lib
from composer_jax.model import embedding, head
from composer_jax.model.attention import KVCache, attention, branch_mask, resolve_kernel, segment_causal_mask
from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import mlp, rms_norm
from composer_jax.model.moe import moe_block
from composer_jax.model.remat import LAYER_INPUT, remat_policy
from composer_jax.model.rope import rope_cos_sin
from composer_jax.parallel.rules import TOKENS, constrain


def _self_attention(p: dict, x_BxLxD: jax.Array, rope, mask, cfg: ModelConfig,
                    cache: KVCache | None) -> tuple[jax.Array, KVCache | None]:
  """Dense MLA with a [B, L, L or S] mask (and optional cache), or context-parallel MLA with mask = (segment ids,
  original indices) [B, L]."""
  cos, sin = rope
  if cfg.attention_impl == "dense":
    return attention(p, x_BxLxD, cos, sin, mask, cfg, cache)
  if cache is not None:
    raise ValueError(f"attention_impl={cfg.attention_impl!r} has no KV cache: decode with attention_impl='dense'")
  return cp_lib.context_parallel_attention(p, x_BxLxD, cos, sin, *mask, cfg), None


def block(p: dict, x_BxLxD: jax.Array, rope: tuple[jax.Array, jax.Array], mask, valid_BxL: jax.Array,
          cfg: ModelConfig, routing_BxLxK: jax.Array | None = None,
          cache: KVCache | None = None) -> tuple[jax.Array, dict, KVCache | None]:
  """One pre-norm decoder layer (attention, then dense MLP or MoE), for training and decoding alike.

  Args:
    p: the layer's params.
    x_BxLxD: input hidden states.
    rope: (cos, sin) at the tokens' positions.
    mask: [B, L, L] bool (no cache, or a fresh one), [B, L, S] (over a cache's S slots), or for context
      parallelism (segment_ids, index) [B, L] in the zig-zag layout (see `hidden_states`).
    valid_BxL: non-padding tokens (MoE load statistics and capacity).
    cfg: model config.
    routing_BxLxK: expert indices to replay (MoE layers).
    cache: this layer's KV cache; the new tokens' latents are written into it.

  Returns:
    (output, aux ({} for dense layers; see `moe.moe_block`), the updated cache or None).
  """
  # The named scopes label the ops in profiles and HLO dumps (`jit(train_step)/.../attention/...`).
  with jax.named_scope("attention"):
    a, cache = _self_attention(p["attn"], rms_norm(x_BxLxD, p["attn_norm"], cfg.rms_norm_eps), rope, mask, cfg,
                               cache)
  h = constrain(x_BxLxD + a, TOKENS)
  y = rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps)
  if "moe" in p:
    with jax.named_scope("moe"):
      out, aux = moe_block(p["moe"], y, valid_BxL, cfg, routing_BxLxK)
  else:
    with jax.named_scope("mlp"):
      out, aux = mlp(p["mlp"], y), {}
  return constrain(h + out, TOKENS), aux, cache


# `scan_layers=None` by platform. XLA:CPU: unrolled. On the colab step (4 layers, 2-core CPU under load 14-20)
# the unrolled step compiled 1.3-1.8x sooner (16-31 s vs 22-55 s) and ran 0.92-1.16x the scanned step's speed in
# three alternating A/Bs (within that load's noise). Elsewhere scan keeps compile time flat in depth.
SCAN_LAYERS_BY_PLATFORM = {"cpu": False}


def scans_layers(cfg: ModelConfig, platform: str | None = None) -> bool:
  """Whether the stacks run under `lax.scan`: `cfg.scan_layers`, or when None the platform's default."""
  if cfg.scan_layers is not None:
    return cfg.scan_layers
  return SCAN_LAYERS_BY_PLATFORM.get(platform or jax.default_backend(), True)


def take_layer(tree, i: int):
  """Layer i of a stacked tree ([Ls, ...] leaves) or of a split one (a tuple of per-layer trees)."""
  return tree[i] if isinstance(tree, tuple) else jax.tree.map(lambda a: a[i], tree)


def run_stack(stack, x_BxLxD: jax.Array, rope, mask, valid_BxL: jax.Array, cfg: ModelConfig,
              routing_LsxBxLxK: jax.Array | None = None, cache: KVCache | None = None):
  """Applies a stack of Ls identical layers; returns (x, aux with a leading Ls axis, cache or None).

  `stack` (and the cache's c / kr) is a tree with a leading Ls axis, run by `lax.scan` when `scans_layers`, or a
  tuple of per-layer trees (`split_layers`, for decode loops), always unrolled. A split stack's cache comes back
  split too.
  """
  def body(x, xs):
    p, r, c = xs
    x = checkpoint_name(x, LAYER_INPUT)   # what remat_policy "offload_layer_input" moves to host memory
    layer_cache = None if cache is None else dataclasses.replace(cache, c=c[0], kr=c[1])
    x, aux, layer_cache = block(p, x, rope, mask, valid_BxL, cfg, r, layer_cache)
    return x, (aux, None if layer_cache is None else (layer_cache.c, layer_cache.kr))

  if cfg.remat:
    body = jax.checkpoint(body, policy=remat_policy(cfg))
  split = isinstance(stack, tuple)
  kv = None if cache is None else (cache.c, cache.kr)
  if scans_layers(cfg) and not split:
    x_BxLxD, (aux, kv) = jax.lax.scan(body, x_BxLxD, (stack, routing_LsxBxLxK, kv))
  else:
    n = len(stack) if split else jax.tree.leaves(stack)[0].shape[0]
    outs = []
    for i in range(n):
      layer_kv = None if kv is None else (take_layer(kv[0], i), take_layer(kv[1], i))
      r = None if routing_LsxBxLxK is None else routing_LsxBxLxK[i]
      x_BxLxD, out = body(x_BxLxD, (take_layer(stack, i), r, layer_kv))
      outs.append(out)
    aux = jax.tree.map(lambda *a: jnp.stack(a), *[o[0] for o in outs])
    if kv is not None:
      kvs = [o[1] for o in outs]
      kv = tuple(tuple(k[j] for k in kvs) if split else jnp.stack([k[j] for k in kvs]) for j in range(2))
  cache = None if cache is None else dataclasses.replace(cache, c=kv[0], kr=kv[1])
  return x_BxLxD, aux, cache


def mtp_block(p: dict, h_BxLxD: jax.Array, e_BxLxD: jax.Array, rope, mask, valid_BxL: jax.Array, cfg: ModelConfig,
              cache: KVCache | None = None) -> tuple[jax.Array, dict, KVCache | None]:
  """One DeepSeek-V3 NextN module before its output norm: h' = eh_proj([enorm(e), hnorm(h)]), one MoE block.

  h is the previous hidden (the trunk's last hidden before the final norm for module 0, else the previous
  module's output) at position t, e the embedding of token t+1+j for module j.
  """
  cat_BxLx2D = jnp.concatenate([rms_norm(e_BxLxD, p["enorm"], cfg.rms_norm_eps),
                                rms_norm(h_BxLxD, p["hnorm"], cfg.rms_norm_eps)], axis=-1)
  return block(p["block"], cat_BxLx2D @ p["eh_proj"].astype(h_BxLxD.dtype), rope, mask, valid_BxL, cfg, None, cache)


def mtp_forward(params: dict, h_BxLxD: jax.Array, tokens_BxL: jax.Array, rope, mask, valid, cfg: ModelConfig,
                detach_trunk: bool = False, cp_size: int = 1) -> tuple[jax.Array, jax.Array]:
  """All NextN modules over a whole sequence; returns (hidden after each module's norm [Nm, B, L, D], expert load
  [Nm, E]).

  Entry j at position t predicts token t+2+j through the shared LM head (`head.lm_head`). Embeddings past the
  end are of token 0 (those positions have no target). With `detach_trunk` the caller must also detach the head
  for these hiddens (`head.lm_head(params, cfg, detach=True)`), as `forward` does.

  With `cp_size` > 1, h, rope, mask and valid are in the zig-zag layout and `tokens_BxL` in natural order: the
  shifted tokens are permuted like h, and the hiddens come back in natural order.
  """
  dt = jnp.dtype(cfg.compute_dtype)
  embed_VxD = jax.lax.stop_gradient(params["embed"]) if detach_trunk else params["embed"]
  h = jax.lax.stop_gradient(h_BxLxD) if detach_trunk else h_BxLxD
  L = tokens_BxL.shape[1]
  hiddens, loads = [], []
  for j in range(cfg.num_nextn_predict_layers):
    p = take_layer(params["mtp"], j)
    shifted_BxL = jnp.pad(tokens_BxL[:, j + 1:], ((0, 0), (0, min(j + 1, L))))[:, :L]
    e_BxLxD = embedding.lookup(embed_VxD, cp_lib.to_zigzag(shifted_BxL, cp_size)).astype(dt)
    h, aux, _ = mtp_block(p, h, e_BxLxD, rope, mask, valid, cfg)
    hiddens.append(cp_lib.from_zigzag(rms_norm(h, p["norm"], cfg.rms_norm_eps), cp_size))
    loads.append(aux["expert_load"])
  if not hiddens:
    return (jnp.zeros((0, *tokens_BxL.shape, cfg.hidden_size), dt), jnp.zeros((0, cfg.n_routed_experts), jnp.float32))
  return jnp.stack(hiddens), jnp.stack(loads)


def hidden_states(params: dict, tokens: jax.Array, cfg: ModelConfig, *, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None, routing: jax.Array | None = None,
                  mtp_detach_trunk: bool = False,
                  branches: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, dict[str, Any]]:
  """Runs the model up to (not including) the LM head: what every loss takes (`model.head`).

  Args:
    params: from `init` (or `interop.hf.load`).
    tokens: int [B, L].
    cfg: model config.
    segment_ids: int [B, L] for packed rows: tokens attend only within their segment; 0 marks padding (it is
      excluded from expert load, balance loss and capacity). Default: one segment per row.
    positions: int [B, L] RoPE positions (restarting per document when packed). Default: 0..L-1.
    routing: optional int32 [Lm, B, L, K] expert indices to replay (e.g. from the inference engine); gate weights
      are recomputed from the current router scores at those indices, so the router still gets gradients.
    mtp_detach_trunk: stop gradients from the MTP modules into the trunk hidden states and the embedding (detach
      the LM head for `aux["mtp_hidden"]` too: `head.lm_head(params, cfg, detach=True)`).
    branches: (branch, branch_end) int [B, L] for rows holding a tree's branches after their shared prefix
      (`attention.branch_mask`); dense attention with the "whole" or "tiled" kernel only (the others take
      segment ids, not a mask).

  With `cfg.attention_impl` "ring" or "allgather" (context parallelism; call under `jax.set_mesh(mesh)`), the
  sequence is sharded on the mesh's `context` axis and L must be divisible by 2 * its size. Inputs and outputs keep
  their natural token order: the stack runs in the zig-zag layout internally (context_parallel.py).

  Returns:
    (h [B, L, D] after the final norm, in the compute dtype, aux) with aux: router_scores f32 [Lm, B, L, E],
    experts int32 [Lm, B, L, K], expert_load f32 [Lm, E], balance_loss (seq_aux_loss_coef * sum over layers),
    balance_loss_unweighted, dropped_fraction (mean over layers; 0 unless moe_impl='capacity'), mtp_hidden
    [Nm, B, L, D] (each MTP module's output after its own norm; entry j at position t predicts token t+2+j, the
    target `train.losses.shifted_targets(..., shift=j + 2)` gives),
    mtp_expert_load f32 [Nm, E] (for the MTP blocks' own router-bias update; MTP routing is never
    replayed).
  """
  B, L = tokens.shape
  dt = jnp.dtype(cfg.compute_dtype)
  n_dense = cfg.first_k_dense_replace
  n_moe = cfg.num_hidden_layers - n_dense
  K, E = cfg.num_experts_per_tok, cfg.n_routed_experts
  if segment_ids is None:
    segment_ids = jnp.ones((B, L), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None], (B, L))
  for name, a in (("segment_ids", segment_ids), ("positions", positions)):
    if a.shape != (B, L):
      raise ValueError(f"{name} has shape {a.shape}, expected tokens' shape {(B, L)}")
  if routing is not None and routing.shape != (n_moe, B, L, K):
    raise ValueError(f"routing has shape {routing.shape}, expected (n_moe_layers, B, L, K) = {(n_moe, B, L, K)}")
  # Context parallelism: run the whole stack in the zig-zag layout (context_parallel.py); the mask becomes each
  # token's segment id and original index, and outputs are put back in natural order below.
  n = 1 if cfg.attention_impl == "dense" else cp_lib.context_size()
  if branches is not None and (cfg.attention_impl != "dense" or resolve_kernel(cfg) == "pallas"):
    raise ValueError(f"rows with a tree's shared prefix stored once need dense attention with the 'whole' or "
                     f"'tiled' kernel, got attention_impl={cfg.attention_impl!r} kernel={resolve_kernel(cfg)!r}: "
                     "set share_prefix=False in the batch config")
  if cfg.attention_impl == "dense":
    mask = segment_causal_mask(segment_ids, segment_ids)
    if branches is not None:
      mask = mask & branch_mask(*branches)
  else:
    index = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None], (B, L))
    mask = (cp_lib.to_zigzag(segment_ids, n), cp_lib.to_zigzag(index, n))
  valid_BxL = cp_lib.to_zigzag(segment_ids, n) != 0
  rope = rope_cos_sin(cp_lib.to_zigzag(positions, n), cfg)
  if routing is not None:
    routing = cp_lib.to_zigzag(routing, n, axis=2)
  x = embedding.lookup(params["embed"], cp_lib.to_zigzag(tokens, n)).astype(dt)   # per device, token layout
  if n_dense:
    x, _, _ = run_stack(params["dense_layers"], x, rope, mask, valid_BxL, cfg)
  if n_moe:
    x, moe_aux, _ = run_stack(params["moe_layers"], x, rope, mask, valid_BxL, cfg, routing)
    moe_aux = dict(moe_aux, router_scores=cp_lib.from_zigzag(moe_aux["router_scores"], n, axis=2),
                   experts=cp_lib.from_zigzag(moe_aux["experts"], n, axis=2))
  else:
    moe_aux = {"router_scores": jnp.zeros((0, B, L, E), jnp.float32), "experts": jnp.zeros((0, B, L, K), jnp.int32),
               "expert_load": jnp.zeros((0, E), jnp.float32), "balance_loss": jnp.zeros((0,), jnp.float32),
               "dropped_fraction": jnp.zeros((0,), jnp.float32)}
  h_BxLxD = cp_lib.from_zigzag(rms_norm(x, params["final_norm"], cfg.rms_norm_eps), n)
  aux = {"router_scores": moe_aux["router_scores"], "experts": moe_aux["experts"],
         "expert_load": moe_aux["expert_load"],
         "balance_loss": cfg.seq_aux_loss_coef * moe_aux["balance_loss"].sum(),
         "balance_loss_unweighted": moe_aux["balance_loss"].sum(),
         "dropped_fraction": moe_aux["dropped_fraction"].mean() if n_moe else jnp.zeros((), jnp.float32)}
  aux["mtp_hidden"], aux["mtp_expert_load"] = mtp_forward(params, x, tokens, rope, mask, valid_BxL, cfg,
                                                          mtp_detach_trunk, cp_size=n)
  return h_BxLxD, aux


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, *, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None, routing: jax.Array | None = None,
            mtp_detach_trunk: bool = False) -> tuple[jax.Array, dict[str, Any]]:
  """`hidden_states` then the LM head: (logits [B, L, V] float32, aux) with aux["mtp_logits"] f32 [Nm, B, L, V].

  Materialises full logits: for sampling, parity tests and small models. Losses use `hidden_states` with the
  chunked `model.head` functions instead (same numbers, no [B, L, V] arrays in the backward).
  """
  h_BxLxD, aux = hidden_states(params, tokens, cfg, segment_ids=segment_ids, positions=positions, routing=routing,
                               mtp_detach_trunk=mtp_detach_trunk)
  aux = dict(aux)
  mtp_hidden = aux.pop("mtp_hidden")
  aux["mtp_logits"] = jax.vmap(head.logits, in_axes=(0, None))(mtp_hidden, head.lm_head(params, cfg, mtp_detach_trunk))
  return head.logits(h_BxLxD, head.lm_head(params, cfg)), aux
