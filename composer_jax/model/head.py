"""The LM head and its losses, chunked over tokens with a custom VJP: [B, L, V] logits are never materialised.

Every loss over the vocabulary (next-token cross-entropy, RL token log-probs and entropy, MTP self-distillation,
evaluation NLL) goes through these functions. The forward runs the head on `chunk_size` tokens at a time and keeps
only per-token statistics (the log-normaliser); the backward recomputes each chunk's logits from h and w and turns
them straight into that chunk's dh and its share of dw. Peak memory is one [Tc, V] block instead of several
[B·L, V] arrays (logits, softmax, its gradient and a transposed copy), which on a CPU is also most of the time the
plain formula spends in the head (the log-softmax backward alone wrote a transposed [4096, 2048] copy per step).

Where the final norm sits: outside. `h` is the hidden state *after* the final RMSNorm (the trunk's `final_norm`,
or an MTP module's own `shared_head.norm`), as `model.hidden_states` returns it; `w_DxV` is `lm_head(params, cfg)`.
The norm has few FLOPs and a per-module weight, so keeping it out lets the trunk and every MTP module share this
one head.

On a mesh (`jax.set_mesh`), every loss runs **per device** (`_per_device`, `per_device.py`): a `jax.shard_map`
over the mesh axes the tokens are split over (`ShardingRules.batch` and `seq`, from `parallel.rules.current_rules()`),
each device running the chunked head on its own tokens only. The weight enters the region in its own (FSDP / vocab)
layout and is all-gathered once inside, so its gradient leaves through the transposed collective, a reduce-scatter,
and only then is summed over the token axes the weight is not split on, on the reduce-scattered shard (on the
256-device Kimi K2 plan that sum crosses nodes: 1/8 of the full gradient instead of all of it). Both reductions run
in the weight's dtype (bf16 in the plan), as the gradient leaves the head in it. Without the region, the partitioner
ran every global chunk on every device and all-reduced each chunk's f32 [Tc, V] logits (forward and backward) over
the FSDP axes. With no mesh, or a mesh whose axes are all of size 1, the plain functions run.

Numerics: logits are accumulated in float32 (`preferred_element_type`) whatever the dtype of h and w; gradients
come back in h's and w's dtypes. `*_reference` beside each function is the plain formula on full logits (tested
equal, values and gradients).

Letters: B batch, L length, T = B·L tokens, D hidden, V vocab, Tc tokens per chunk, n number of chunks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from composer_jax.model import per_device
from composer_jax.model.config import ModelConfig
from composer_jax.parallel.rules import current_rules

DEFAULT_CHUNK = 512   # tokens per chunk: [512, V] float32 blocks (8 MiB at V = 4096); measured on the colab step


def lm_head(params: dict, cfg: ModelConfig, detach: bool = False) -> jax.Array:
  """The head's weight w [D, V] (the transposed embedding when tied); `detach` stops its gradient."""
  w_DxV = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return jax.lax.stop_gradient(w_DxV) if detach else w_DxV


def logits(h_xD: jax.Array, w_DxV: jax.Array) -> jax.Array:
  """Full float32 logits [..., V] of h [..., D] (sampling and tests; losses use the chunked functions below)."""
  return jnp.einsum("...d,dv->...v", h_xD, w_DxV.astype(h_xD.dtype), preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------- chunking helpers

def _chunks(x_Tx_: jax.Array, Tc: int) -> jax.Array:
  """[T, ...] → [n, Tc, ...], zero-padded at the end to a whole number of chunks."""
  T = x_Tx_.shape[0]
  n = -(-T // Tc)
  pad = [(0, n * Tc - T)] + [(0, 0)] * (x_Tx_.ndim - 1)
  return jnp.pad(x_Tx_, pad).reshape(n, Tc, *x_Tx_.shape[1:])


def _unchunk(x_nxCx_: jax.Array, T: int) -> jax.Array:
  return x_nxCx_.reshape(-1, *x_nxCx_.shape[2:])[:T]


def _chunk_size(chunk_size: int, T: int) -> int:
  if chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size} must be >= 1")
  return min(chunk_size, max(T, 1))


def _zeros_varying_like(shape, xs) -> jax.Array:
  """float32 zeros varying over every manual mesh axis any of `xs` varies over: a scan carry that accumulates
  sums of them inside a `shard_map` (the per-device head) must start varying, or its type changes after one step."""
  zeros = jnp.zeros(shape, jnp.float32)
  vma = tuple(sorted(frozenset().union(*(_vma(x) for x in jax.tree.leaves(xs)))))
  return jax.lax.pcast(zeros, vma, to="varying") if vma else zeros


def _sum_to_match(dw: jax.Array, w: jax.Array) -> jax.Array:
  """Sums a weight's per-device gradient over the manual mesh axes it varies on and the weight does not: inside
  the per-device head those are token axes, over which each device saw different tokens."""
  extra = tuple(sorted(_vma(dw) - _vma(w)))
  return jax.lax.psum(dw, extra) if extra else dw


def _vma(x) -> frozenset:
  return jax.typeof(x).manual_axis_type.varying


def _chunk_logits(h_TcxD: jax.Array, w_DxV: jax.Array) -> jax.Array:
  return jnp.dot(h_TcxD, w_DxV.astype(h_TcxD.dtype), preferred_element_type=jnp.float32)


def _backward_chunks(dz_fn, xs, h_TxD: jax.Array, w_DxV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(dh [T, D] in h's dtype, dw [D, V] in w's dtype) from the logits' gradient `dz_fn(chunk) -> dz [Tc, V]`
  (float32), chunk by chunk over `xs` (whose first entry is h's chunks); dz enters both products in h's dtype.

  dw is either accumulated over the chunks in a float32 [D, V] scan carry or, when the token count is small
  beside D (the stacked dz [T, V] in h's dtype takes no more bytes than one float32 [D, V]), computed as one
  product of h with the stacked dz: the carry costs three [D, V] float32 buffers in the loop (carry, product,
  sum; on the 256-device Kimi K2 plan 14 GB of the peak) where the stack and one product cost less than two.
  """
  T, D = h_TxD.shape
  V = w_DxV.shape[1]
  dt = h_TxD.dtype
  w_c = w_DxV.astype(dt)

  def dh_of(dz_TcxV):
    return jnp.dot(dz_TcxV, w_c.T, preferred_element_type=jnp.float32).astype(dt)

  if T * V * dt.itemsize <= D * V * 4:
    def one(args):
      dz_TcxV = dz_fn(args).astype(dt)
      return dh_of(dz_TcxV), dz_TcxV
    dh, dz = jax.lax.map(one, xs)
    dw_DxV = jnp.dot(h_TxD.T, _unchunk(dz, T), preferred_element_type=jnp.float32)
  else:
    def acc(dw_DxV, args):
      dz_TcxV = dz_fn(args).astype(dt)
      return dw_DxV + jnp.dot(args[0].T, dz_TcxV, preferred_element_type=jnp.float32), dh_of(dz_TcxV)
    dw_DxV, dh = jax.lax.scan(acc, _zeros_varying_like(w_DxV.shape, (xs, w_DxV)), xs)
  return _unchunk(dh, T), _sum_to_match(dw_DxV, w_DxV).astype(w_DxV.dtype)


# ------------------------------------------------------------------------------------------ per device on a mesh

def _per_device(local_fn, h_BxLxD: jax.Array, ws: tuple[jax.Array, ...], tokens: tuple[jax.Array, ...], n_out: int):
  """`local_fn(h, ws, tokens) -> n_out [B, L] arrays` on each device's own tokens (see the module docstring).

  Every w in `ws` is [D, V] in the head weight's layout (logical ("embed", "vocab")); `tokens` are [B, L] (or
  [B, L, D] like h) arrays split like h.
  """
  mesh = per_device.active_mesh()
  if mesh is None:
    return local_fn(h_BxLxD, ws, tokens)
  B, L, D = h_BxLxD.shape
  tok, w_spec, gathers, rest = per_device.region_layout(B, L, ws[0].shape, ("embed", "vocab"), mesh, current_rules())

  def body(h_bxlxD, ws_local, tokens_local):
    # One gather of each weight per call; its transpose reduce-scatters the weight's gradient, then sums the shard.
    return local_fn(h_bxlxD, tuple(per_device.gather(w, gathers, rest) for w in ws_local), tokens_local)

  tok_specs = tuple(P(*tok, *([None] * (t.ndim - 2))) for t in tokens)
  region = jax.shard_map(body, mesh=mesh, in_specs=(P(*tok, None), (w_spec,) * len(ws), tok_specs),
                         out_specs=(tok,) * n_out)
  return region(h_BxLxD, ws, tokens)


# ---------------------------------------------------------------------------------- token log-probs and entropy

def _stats(z_TcxV: jax.Array, t_Tc: jax.Array, with_entropy: bool):
  """(log p(target), entropy or None, logsumexp) per row of float32 logits."""
  lse_Tc = jax.nn.logsumexp(z_TcxV, axis=-1)
  logp_t_Tc = jnp.take_along_axis(z_TcxV, t_Tc[:, None], axis=-1)[:, 0] - lse_Tc
  if not with_entropy:   # the LM loss: two passes over the logits (max, sum of exp), not four
    return logp_t_Tc, None, lse_Tc
  logp_TcxV = z_TcxV - lse_Tc[:, None]
  ent_Tc = -jnp.sum(jnp.exp(logp_TcxV) * logp_TcxV, axis=-1)
  return logp_t_Tc, ent_Tc, lse_Tc


def _logprobs_fwd_chunks(h_TxD, w_DxV, t_T, Tc, with_entropy):
  def one(args):
    h_TcxD, t_Tc = args
    logp, ent, lse = _stats(_chunk_logits(h_TcxD, w_DxV), t_Tc, with_entropy)
    return logp, jnp.zeros_like(logp) if ent is None else ent, lse
  logp, ent, lse = jax.lax.map(one, (_chunks(h_TxD, Tc), _chunks(t_T, Tc)))
  T = h_TxD.shape[0]
  return _unchunk(logp, T), _unchunk(ent, T), _unchunk(lse, T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _token_stats(h_TxD, w_DxV, t_T, Tc, with_entropy):
  logp_T, ent_T, _ = _logprobs_fwd_chunks(h_TxD, w_DxV, t_T, Tc, with_entropy)
  return logp_T, ent_T


def _token_stats_fwd(h_TxD, w_DxV, t_T, Tc, with_entropy):
  # symbolic_zeros=True: the primals come wrapped (CustomVJPPrimal), and unused outputs' cotangents as SymbolicZero.
  h_TxD, w_DxV, t_T = h_TxD.value, w_DxV.value, t_T.value
  logp_T, ent_T, lse_T = _logprobs_fwd_chunks(h_TxD, w_DxV, t_T, Tc, with_entropy)
  return (logp_T, ent_T), (h_TxD, w_DxV, t_T, lse_T, ent_T)


def _token_stats_bwd(Tc, with_entropy, res, g):
  """d logp_t/dz = onehot(t) − p;  dH/dz = −p ⊙ (log p + H). Per chunk: dz → dh = dz wᵀ, dw += hᵀ dz.
  The entropy term runs only if the entropy is differentiated (the RL step's entropy is a stop-gradient metric:
  its cotangent is a symbolic zero); without `with_entropy` the entropy output is zeros and never differentiated."""
  h_TxD, w_DxV, t_T, lse_T, ent_T = res
  g_logp_T, g_ent_T = (jnp.zeros(ent_T.shape, jnp.float32) if isinstance(x, jax.custom_derivatives.SymbolicZero)
                       else x for x in g)
  with_entropy = with_entropy and not isinstance(g[1], jax.custom_derivatives.SymbolicZero)
  V = w_DxV.shape[1]

  def dz(args):
    h_TcxD, t_Tc, lse_Tc, ent_Tc, gl_Tc, ge_Tc = args
    logp_TcxV = _chunk_logits(h_TcxD, w_DxV) - lse_Tc[:, None]
    p_TcxV = jnp.exp(logp_TcxV)
    onehot_TcxV = jax.nn.one_hot(t_Tc, V, dtype=jnp.float32)
    dz_TcxV = gl_Tc[:, None] * (onehot_TcxV - p_TcxV)
    if with_entropy:
      dz_TcxV = dz_TcxV - ge_Tc[:, None] * p_TcxV * (logp_TcxV + ent_Tc[:, None])
    return dz_TcxV

  xs = tuple(_chunks(a, Tc) for a in (h_TxD, t_T, lse_T, ent_T, g_logp_T.astype(jnp.float32),
                                     g_ent_T.astype(jnp.float32)))
  dh_TxD, dw_DxV = _backward_chunks(dz, xs, h_TxD, w_DxV)
  return dh_TxD, dw_DxV, None


_token_stats.defvjp(_token_stats_fwd, _token_stats_bwd, symbolic_zeros=True)


def token_logprobs(h_BxLxD: jax.Array, w_DxV: jax.Array, targets_BxL: jax.Array, *, chunk_size: int = DEFAULT_CHUNK,
                   with_entropy: bool = False):
  """log softmax(h w)[target] per token, chunked; differentiable in h and w.

  Args:
    h_BxLxD: hidden states after the final norm (any float dtype).
    w_DxV: the head's weight (`lm_head(params, cfg)`); cast to h's dtype for the matmul, accumulated in float32.
    targets_BxL: int token ids in [0, V).
    chunk_size: tokens per chunk (any positive number; the last chunk is padded).
    with_entropy: also return the entropy of each token's distribution (differentiable too).

  Returns:
    logp_BxL float32, or (logp_BxL, entropy_BxL) with `with_entropy`.
  """
  B, L, D = h_BxLxD.shape
  if targets_BxL.shape != (B, L):
    raise ValueError(f"targets have shape {targets_BxL.shape}, expected h's leading shape {(B, L)}")
  if w_DxV.shape[0] != D:
    raise ValueError(f"w has shape {w_DxV.shape}, expected [D={D}, V]")

  def local(h_bxlxD, ws, tokens):
    b, l, _ = h_bxlxD.shape
    logp_T, ent_T = _token_stats(h_bxlxD.reshape(b * l, D), ws[0], tokens[0].reshape(b * l).astype(jnp.int32),
                                 _chunk_size(chunk_size, b * l), with_entropy)
    return logp_T.reshape(b, l), ent_T.reshape(b, l)
  with jax.named_scope("lm_head"):
    logp_BxL, ent_BxL = _per_device(local, h_BxLxD, (w_DxV,), (targets_BxL,), 2)
  return (logp_BxL, ent_BxL) if with_entropy else logp_BxL


def token_logprobs_reference(h_BxLxD: jax.Array, w_DxV: jax.Array, targets_BxL: jax.Array, *,
                             with_entropy: bool = False):
  """The plain formula on full [B, L, V] logits (what `token_logprobs` computes)."""
  logp_BxLxV = jax.nn.log_softmax(logits(h_BxLxD, w_DxV), axis=-1)
  logp_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None].astype(jnp.int32), axis=-1)[..., 0]
  if with_entropy:
    return logp_BxL, -jnp.sum(jnp.exp(logp_BxLxV) * logp_BxLxV, axis=-1)
  return logp_BxL


def cross_entropy(h_BxLxD: jax.Array, w_DxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array, *,
                  chunk_size: int = DEFAULT_CHUNK) -> tuple[jax.Array, jax.Array]:
  """Masked mean next-token cross-entropy and the number of counted tokens (mask: 1 = counted)."""
  nll_BxL = -token_logprobs(h_BxLxD, w_DxV, targets_BxL, chunk_size=chunk_size)
  mask = mask_BxL.astype(jnp.float32)
  n = jnp.sum(mask)
  return jnp.sum(nll_BxL * mask) / jnp.maximum(n, 1.0), n


def cross_entropy_reference(h_BxLxD, w_DxV, targets_BxL, mask_BxL) -> tuple[jax.Array, jax.Array]:
  nll_BxL = -token_logprobs_reference(h_BxLxD, w_DxV, targets_BxL)
  mask = mask_BxL.astype(jnp.float32)
  n = jnp.sum(mask)
  return jnp.sum(nll_BxL * mask) / jnp.maximum(n, 1.0), n


# ------------------------------------------------------------------------------------ distillation to a teacher

def _distill_fwd_chunks(h_TxD, w_DxV, th_TxD, tw_DxV, Tc):
  def one(args):
    h_TcxD, th_TcxD = args
    z_TcxV = _chunk_logits(h_TcxD, w_DxV)
    tz_TcxV = _chunk_logits(th_TcxD, tw_DxV)
    lse_Tc = jax.nn.logsumexp(z_TcxV, axis=-1)
    q_TcxV = jax.nn.softmax(tz_TcxV, axis=-1)
    ce_Tc = lse_Tc - jnp.sum(q_TcxV * z_TcxV, axis=-1)     # −Σ q log p, with Σ q = 1
    agree_Tc = (jnp.argmax(z_TcxV, -1) == jnp.argmax(tz_TcxV, -1)).astype(jnp.float32)
    return ce_Tc, agree_Tc, lse_Tc
  ce, agree, lse = jax.lax.map(one, (_chunks(h_TxD, Tc), _chunks(th_TxD, Tc)))
  T = h_TxD.shape[0]
  return _unchunk(ce, T), _unchunk(agree, T), _unchunk(lse, T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _distill(h_TxD, w_DxV, th_TxD, tw_DxV, Tc):
  ce_T, agree_T, _ = _distill_fwd_chunks(h_TxD, w_DxV, th_TxD, tw_DxV, Tc)
  return ce_T, agree_T


def _distill_fwd(h_TxD, w_DxV, th_TxD, tw_DxV, Tc):
  ce_T, agree_T, lse_T = _distill_fwd_chunks(h_TxD, w_DxV, th_TxD, tw_DxV, Tc)
  return (ce_T, agree_T), (h_TxD, w_DxV, th_TxD, tw_DxV, lse_T)


def _distill_bwd(Tc, res, g):
  """d(−Σ q log p)/dz = p − q; the teacher (q) gets no gradient."""
  h_TxD, w_DxV, th_TxD, tw_DxV, lse_T = res
  g_ce_T = g[0]

  def dz(args):
    h_TcxD, th_TcxD, lse_Tc, g_Tc = args
    p_TcxV = jnp.exp(_chunk_logits(h_TcxD, w_DxV) - lse_Tc[:, None])
    q_TcxV = jax.nn.softmax(_chunk_logits(th_TcxD, tw_DxV), axis=-1)
    return g_Tc[:, None] * (p_TcxV - q_TcxV)

  xs = tuple(_chunks(a, Tc) for a in (h_TxD, th_TxD, lse_T, g_ce_T.astype(jnp.float32)))
  dh_TxD, dw_DxV = _backward_chunks(dz, xs, h_TxD, w_DxV)
  return dh_TxD, dw_DxV, jnp.zeros_like(th_TxD), jnp.zeros_like(tw_DxV)


_distill.defvjp(_distill_fwd, _distill_bwd)


def distill_cross_entropy(h_BxLxD: jax.Array, w_DxV: jax.Array, teacher_h_BxLxD: jax.Array,
                          teacher_w_DxV: jax.Array | None = None, *, chunk_size: int = DEFAULT_CHUNK):
  """Per-token −Σ_v q_v log p_v with p = softmax(h w), q = softmax(teacher_h teacher_w) held fixed (no gradient).

  The MTP self-distillation loss: the student is an MTP module's hidden, the teacher the trunk's hidden at the
  position that predicts the same token. Differentiable in h and w only.

  Returns:
    (cross-entropy [B, L] float32, top-1 agreement [B, L] float32: argmax p == argmax q).
  """
  B, L, D = h_BxLxD.shape
  if teacher_h_BxLxD.shape != h_BxLxD.shape:
    raise ValueError(f"teacher_h has shape {teacher_h_BxLxD.shape}, expected h's shape {h_BxLxD.shape}")
  tw_DxV = w_DxV if teacher_w_DxV is None else teacher_w_DxV

  def local(h_bxlxD, ws, tokens):
    b, l, _ = h_bxlxD.shape
    ce_T, agree_T = _distill(h_bxlxD.reshape(b * l, D), ws[0], tokens[0].reshape(b * l, D).astype(h_bxlxD.dtype),
                             ws[1], _chunk_size(chunk_size, b * l))
    return ce_T.reshape(b, l), agree_T.reshape(b, l)
  with jax.named_scope("lm_head"):
    return _per_device(local, h_BxLxD, (w_DxV, jax.lax.stop_gradient(tw_DxV)), (teacher_h_BxLxD,), 2)


def distill_cross_entropy_reference(h_BxLxD, w_DxV, teacher_h_BxLxD, teacher_w_DxV=None):
  tw_DxV = w_DxV if teacher_w_DxV is None else teacher_w_DxV
  z = logits(h_BxLxD, w_DxV)
  tz = jax.lax.stop_gradient(logits(teacher_h_BxLxD, tw_DxV))
  ce = -jnp.sum(jax.nn.softmax(tz, axis=-1) * jax.nn.log_softmax(z, axis=-1), axis=-1)
  return ce, (jnp.argmax(z, -1) == jnp.argmax(tz, -1)).astype(jnp.float32)
