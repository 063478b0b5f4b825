"""Context parallelism: MLA attention over a sequence sharded on the `context` mesh axis.

Two `jax.shard_map` regions, manual over `context` only (every other mesh axis stays automatic, so heads sharded on
`tensor` stay sharded inside the region and batch stays on `data`: CP and TP are independent):

- `ring_attention`: queries stay on their device; the KV blocks travel around a ring with `lax.ppermute`, one hop
  per step, merged with an online softmax (running max and sum in float32).
- `allgather_attention`: all-gather the KV once, attend locally (simpler; KV memory is the full sequence's).

Both pass MLA's compact latent (c [S, C] and the rotated rope key kr [S, R]) rather than per-head keys/values and
expand it locally with the head-sharded `k_b`/`v_b`: C + R values per token on the wire instead of H * (Q + Dv)
(DeepSeek-V3: 576 vs 40,960 per token, 71x fewer bytes). The price is re-expanding each arriving block, C * H *
(Qn + Dv) FLOPs per key against L_blk * H * (Q + Dv) for attending to it: a few percent once L_blk is in the
thousands. The mask is built from segment ids and each token's original sequence index, which travel with the
KV block, so packed rows work and no [L, S] mask is ever materialised.

Layout. A causal ring is balanced only if every device owns early and late tokens: the sequence is cut into 2N
chunks and device i holds chunks i and 2N-1-i (zig-zag). `transformer.forward` permutes into that layout at the
embedding and back before the heads (`to_zigzag` / `from_zigzag`), so positions (RoPE), segment ids, router replay
inputs, MTP targets and the loss mask all keep their natural order outside the model.

The mesh comes from the context (`with jax.set_mesh(mesh):` around the jitted call): `shard_map(mesh=None)` picks
it up, and `get_abstract_mesh()` gives the `context` size at trace time.

Letters: B batch, L local query length, S local key length, H heads, Qn nope head dim, R rope head dim,
Q = Qn + R, Dv value head dim, C kv_lora_rank, N context-parallel size.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from composer_jax.model.attention import expand_kv, latent_kv, queries
from composer_jax.model.config import ModelConfig
from composer_jax.model.rope import softmax_scale

AXIS = "context"


def context_size() -> int:
  """Size of the `context` axis of the mesh set with `jax.set_mesh` (1 when there is no such axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


def zigzag_order(length: int, n: int) -> np.ndarray:
  """Original indices in zig-zag order: 2n chunks, chunk pairs (0, 2n-1), (1, 2n-2), ... laid out device by device."""
  if length % (2 * n):
    raise ValueError(f"Sequence length {length} must be divisible by 2 * context size = {2 * n} for the zig-zag layout")
  chunks = np.arange(length).reshape(2 * n, length // (2 * n))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def to_zigzag_reference(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  """Permutes `axis` (the sequence) into the zig-zag layout with a gather (the reference for `to_zigzag`)."""
  return x if n == 1 else jnp.take(x, zigzag_order(x.shape[axis], n), axis=axis)


def from_zigzag_reference(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  """Inverse of `to_zigzag_reference`."""
  return x if n == 1 else jnp.take(x, np.argsort(zigzag_order(x.shape[axis], n)), axis=axis)


def _swap_halves(x, *, n: int, axis: int, inverse: bool):
  """Per-device body of `to_zigzag` / `from_zigzag`: two half-chunk `ppermute`s, nothing gathered.

  Contiguous layout: device i holds halves (2i, 2i+1); zig-zag: device i holds halves (i, 2n-1-i). In either
  direction each device sends exactly one half to each of two permutations whose targets are all distinct, so
  each is one `ppermute`.
  """
  i = jax.lax.axis_index(AXIS)
  lo, hi = jnp.split(x, 2, axis=axis)
  if not inverse:  # half 2i goes to the device owning it in zig-zag order, likewise half 2i+1
    dest = lambda h: h if h < n else 2 * n - 1 - h  # noqa: E731
    a = jax.lax.ppermute(lo, AXIS, [(d, dest(2 * d)) for d in range(n)])
    b = jax.lax.ppermute(hi, AXIS, [(d, dest(2 * d + 1)) for d in range(n)])
    # Device d received half d and half 2n-1-d; the even-numbered one came through `a`.
    first, second = jnp.where(i % 2 == 0, a, b), jnp.where(i % 2 == 0, b, a)
  else:  # device d holds halves d and 2n-1-d, one even, one odd: send each to its contiguous home h // 2
    even, odd = jnp.where(i % 2 == 0, lo, hi), jnp.where(i % 2 == 0, hi, lo)
    half = lambda d, parity: d if d % 2 == parity else 2 * n - 1 - d  # noqa: E731
    first = jax.lax.ppermute(even, AXIS, [(d, half(d, 0) // 2) for d in range(n)])
    second = jax.lax.ppermute(odd, AXIS, [(d, half(d, 1) // 2) for d in range(n)])
  return jnp.concatenate([first, second], axis=axis)


def _permute(x: jax.Array, n: int, axis: int, inverse: bool) -> jax.Array:
  if n == 1:
    return x
  if n != context_size():
    raise ValueError(f"Zig-zag over {n} devices needs a mesh (jax.set_mesh) whose 'context' axis has size {n}; "
                     f"the current one has {context_size()}")
  zigzag_order(x.shape[axis], n)  # validates the length
  spec = P(*([None] * axis), AXIS)
  fn = jax.shard_map(lambda a: _swap_halves(a, n=n, axis=axis, inverse=inverse), axis_names={AXIS},
                     in_specs=spec, out_specs=spec)
  with jax.named_scope("from_zigzag" if inverse else "to_zigzag"):
    return fn(x)


def to_zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  """Permutes `axis` (the sequence, sharded on `context` of size n) into the zig-zag layout (identity for n = 1)."""
  return _permute(x, n, axis, inverse=False)


def from_zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  """Inverse of `to_zigzag`."""
  return _permute(x, n, axis, inverse=True)


def _block_mask(seg_q_BxL, idx_q_BxL, seg_k_BxS, idx_k_BxS) -> jax.Array:
  """[B, L, S]: same segment and key index <= query index (original sequence indices)."""
  same = seg_q_BxL[:, :, None] == seg_k_BxS[:, None, :]
  return same & (idx_k_BxS[:, None, :] <= idx_q_BxL[:, :, None])


def _logits(q_BxLxHxQ, k_BxSxHxQ, mask_BxLxS, scale) -> jax.Array:
  """Masked logits [B, H, L, S] in float32 (-inf where masked)."""
  logits = jnp.einsum("blhq,bshq->bhls", q_BxLxHxQ, k_BxSxHxQ, preferred_element_type=jnp.float32) * scale
  return jnp.where(mask_BxLxS[:, None], logits, -jnp.inf)


def _online_update(acc, q_BxLxHxQ, kv, kvb, seg_q, idx_q, scale):
  """Folds one KV block into the running (out [B,H,L,Dv], max [B,H,L], sum [B,H,L]), all float32."""
  o_BxHxLxDv, m_BxHxL, l_BxHxL = acc
  c_BxSxC, kr_BxSxR, seg_k, idx_k = kv
  k_BxSxHxQ, v_BxSxHxDv = expand_kv(kvb, c_BxSxC, kr_BxSxR)
  logits = _logits(q_BxLxHxQ, k_BxSxHxQ, _block_mask(seg_q, idx_q, seg_k, idx_k), scale)
  # The max only stabilises exp; the result does not depend on it, so it carries no gradient.
  m_new = jnp.maximum(m_BxHxL, jax.lax.stop_gradient(logits.max(-1)))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet: exp(-inf - 0) = 0
  p_BxHxLxS = jnp.exp(logits - m_safe[..., None])
  alpha = jnp.exp(m_BxHxL - m_safe)
  o = alpha[..., None] * o_BxHxLxDv + jnp.einsum("bhls,bshv->bhlv", p_BxHxLxS.astype(v_BxSxHxDv.dtype), v_BxSxHxDv,
                                                 preferred_element_type=jnp.float32)
  return o, m_new, alpha * l_BxHxL + p_BxHxLxS.sum(-1)


def _finish(o_BxHxLxDv, l_BxHxL, dtype) -> jax.Array:
  """Normalises the accumulator → [B, L, H, Dv]; a row that saw no key gives zeros (as `attend`)."""
  out = jnp.where(l_BxHxL[..., None] > 0, o_BxHxLxDv / jnp.where(l_BxHxL > 0, l_BxHxL, 1.0)[..., None], 0.0)
  return out.transpose(0, 2, 1, 3).astype(dtype)


def _ring_region(q_BxLxHxQ, c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL, kvb, *, scale: float, n: int):
  """Per-device body of `ring_attention` (manual over `context`; inputs in the zig-zag layout).

  Device i holds query chunks (i, 2n-1-i). At ring step t it holds the KV of device j = i - t (mod n), chunks
  (j, 2n-1-j). For j < i both query chunks see KV chunk j entirely and chunk 2n-1-j not at all: attend all
  queries to the first KV half. For j > i only query chunk 2n-1-i sees anything, and it sees both KV chunks:
  attend the second query half to all KV. Every device does half a block per step (the zig-zag balance), and only
  step 0 (j = i) needs the causal diagonal. The index/segment mask is still applied in every case.
  """
  B, L, H, _ = q_BxLxHxQ.shape
  Dv = kvb["v_b"].shape[-1]
  f32 = jnp.float32
  acc = (jnp.zeros((B, H, L, Dv), f32), jnp.full((B, H, L), -jnp.inf, f32), jnp.zeros((B, H, L), f32))
  acc = jax.lax.pcast(acc, (AXIS,), to="varying")
  kv = (c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL)
  ring = [(d, (d + 1) % n) for d in range(n)]
  i = jax.lax.axis_index(AXIS)
  half = L // 2
  update = jax.checkpoint(_online_update, static_argnums=(6,))
  acc = update(acc, q_BxLxHxQ, kv, kvb, seg_BxL, idx_BxL, scale)

  def earlier(acc, kv):  # j < i: all queries x first KV half
    return update(acc, q_BxLxHxQ, tuple(a[:, :half] for a in kv), kvb, seg_BxL, idx_BxL, scale)

  def later(acc, kv):  # j > i: second query half x all KV
    lo, hi = zip(*((a[:, :, :half], a[:, :, half:]) for a in acc))  # acc leaves are [B, H, L, ...]
    hi = update(hi, q_BxLxHxQ[:, half:], kv, kvb, seg_BxL[:, half:], idx_BxL[:, half:], scale)
    return tuple(jnp.concatenate([a, b], axis=2) for a, b in zip(lo, hi))

  # Rematerialised: the backward pass recomputes a block's logits instead of storing n of them.
  @jax.checkpoint
  def step(carry, t):
    acc, kv = carry
    kv = jax.lax.ppermute(kv, AXIS, ring)
    acc = jax.lax.cond((i - t) % n < i, earlier, later, acc, kv)
    return (acc, kv), None

  (acc, _), _ = jax.lax.scan(step, (acc, kv), jnp.arange(1, n))
  o, _, l = acc
  return _finish(o, l, q_BxLxHxQ.dtype)


def _allgather_region(q_BxLxHxQ, c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL, kvb, *, scale: float, n: int):
  """Per-device body of `allgather_attention`: gather the whole sequence's latent, attend in one block."""
  del n
  gather = lambda a: jax.lax.all_gather(a, AXIS, axis=1, tiled=True)  # noqa: E731
  kv = tuple(gather(a) for a in (c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL))
  B, L, H, _ = q_BxLxHxQ.shape
  f32 = jnp.float32
  acc = (jnp.zeros((B, H, L, kvb["v_b"].shape[-1]), f32), jnp.full((B, H, L), -jnp.inf, f32),
         jnp.zeros((B, H, L), f32))
  o, _, l = _online_update(jax.lax.pcast(acc, (AXIS,), to="varying"), q_BxLxHxQ, kv, kvb, seg_BxL, idx_BxL, scale)
  return _finish(o, l, q_BxLxHxQ.dtype)


def _sharded(region, q_BxLxHxQ, c_BxLxC, kr_BxLxR, segment_ids_BxL, index_BxL, kvb, scale):
  n = context_size()
  L = q_BxLxHxQ.shape[1]
  multiple = 2 * n if region is _ring_region and n > 1 else n  # the ring works on zig-zag half chunks
  if L % multiple:
    raise ValueError(f"Sequence length {L} is not divisible by {multiple} (context axis size {n}"
                     f"{', times 2 for the zig-zag ring' if multiple != n else ''})")
  seq = P(None, AXIS)
  fn = jax.shard_map(lambda *a: region(*a, scale=scale, n=n), axis_names={AXIS},
                     in_specs=(seq, seq, seq, seq, seq, P()), out_specs=seq)
  with jax.named_scope(region.__name__.strip("_")):
    return fn(q_BxLxHxQ, c_BxLxC, kr_BxLxR, segment_ids_BxL, index_BxL, kvb)


def ring_attention(q_BxLxHxQ: jax.Array, c_BxLxC: jax.Array, kr_BxLxR: jax.Array, segment_ids_BxL: jax.Array,
                   index_BxL: jax.Array, kvb: dict, scale: float) -> jax.Array:
  """Ring attention over the `context` axis of the current mesh → [B, L, H, Dv] (global shapes).

  Args:
    q_BxLxHxQ: queries (nope then rotated rope part), in the zig-zag layout like every other sequence input.
    c_BxLxC: the normed KV latent; kr_BxLxR: the rotated shared rope key.
    segment_ids_BxL: packing segments (keys are visible only within the query's segment).
    index_BxL: each token's original index in the row (for causality after the zig-zag permutation).
    kvb: {"k_b": [C, H, Qn], "v_b": [C, H, Dv]} expansion weights.
    scale: softmax scale.
  """
  return _sharded(_ring_region, q_BxLxHxQ, c_BxLxC, kr_BxLxR, segment_ids_BxL, index_BxL, kvb, scale)


def allgather_attention(q_BxLxHxQ: jax.Array, c_BxLxC: jax.Array, kr_BxLxR: jax.Array, segment_ids_BxL: jax.Array,
                        index_BxL: jax.Array, kvb: dict, scale: float) -> jax.Array:
  """As `ring_attention`, but all-gathers the latent KV over `context` once instead of passing it around."""
  return _sharded(_allgather_region, q_BxLxHxQ, c_BxLxC, kr_BxLxR, segment_ids_BxL, index_BxL, kvb, scale)


CP_ATTENTION = {"ring": ring_attention, "allgather": allgather_attention}


def context_parallel_attention(p: dict, x_BxLxD: jax.Array, cos: jax.Array, sin: jax.Array,
                               segment_ids_BxL: jax.Array, index_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
  """MLA self-attention (as `model.attention.attention`) with the attend step sharded over `context` → [B, L, D].

  Inputs are in the zig-zag layout; `cfg.attention_impl` picks the region ("ring" or "allgather").
  """
  if cfg.attention_impl not in CP_ATTENTION:
    raise ValueError(f"attention_impl={cfg.attention_impl!r} is not context-parallel; valid: {sorted(CP_ATTENTION)}")
  q_BxLxHxQ = queries(p, x_BxLxD, cos, sin, cfg)
  c_BxLxC, kr_BxLxR = latent_kv(p, x_BxLxD, cos, sin, cfg)
  out_BxLxHxDv = CP_ATTENTION[cfg.attention_impl](q_BxLxHxQ, c_BxLxC, kr_BxLxR, segment_ids_BxL, index_BxL,
                                                   {"k_b": p["k_b"], "v_b": p["v_b"]}, softmax_scale(cfg))
  return jnp.einsum("blhv,hvd->bld", out_BxLxHxDv, p["o"].astype(x_BxLxD.dtype))
