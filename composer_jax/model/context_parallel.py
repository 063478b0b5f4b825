"""Context parallelism: MLA attention over a sequence sharded on the `context` mesh axis.

Two `jax.shard_map` regions, manual over `context` only (every other mesh axis stays automatic, so heads sharded on
`tensor` stay sharded inside the region and batch stays on `data`: CP and TP are independent):

- `ring_attention`: queries stay on their device; the KV blocks travel around a ring with `lax.ppermute`, one hop
  per step, merged with an online softmax (running max and sum in float32); a backward ring of its own
  (ring_attention.py), so per-device memory stays O(L/N).
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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from composer_jax.model import ring_attention as ring_lib
from composer_jax.model import tiled_attention as tiled
from composer_jax.model.attention import latent_kv, queries
from composer_jax.model.config import ModelConfig
from composer_jax.model.rope import softmax_scale

AXIS = ring_lib.AXIS


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


def _swap_halves(x, me_1, *, n: int, axis: int, inverse: bool):
  """Per-device body of `to_zigzag` / `from_zigzag`: two half-chunk `ppermute`s, nothing gathered.

  Contiguous layout: device i holds halves (2i, 2i+1); zig-zag: device i holds halves (i, 2n-1-i). In either
  direction each device sends exactly one half to each of two permutations whose targets are all distinct, so
  each is one `ppermute`. me_1: [1] this device's index on `context` (`ring_attention.shard_index`).
  """
  i = me_1[0]
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
  fn = jax.shard_map(functools.partial(_swap_halves, n=n, axis=axis, inverse=inverse), axis_names={AXIS},
                     in_specs=(spec, P(AXIS)), out_specs=spec)
  with jax.named_scope("from_zigzag" if inverse else "to_zigzag"):
    return fn(x, ring_lib.shard_index(n))


def to_zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  """Permutes `axis` (the sequence, sharded on `context` of size n) into the zig-zag layout (identity for n = 1)."""
  return _permute(x, n, axis, inverse=False)


def from_zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  """Inverse of `to_zigzag`."""
  return _permute(x, n, axis, inverse=True)


def _allgather_region(q_BxLxHxQ, c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL, kvb, *, scale: float, block: int):
  """Per-device body of `allgather_attention`: gather the whole sequence's latent, attend to it (tiled; autodiff
  through the tiled loop, which keeps every tile's probabilities: this path trades memory for simplicity)."""
  gather = lambda a: jax.lax.all_gather(a, AXIS, axis=1, tiled=True)  # noqa: E731
  kv = tuple(gather(a) for a in (c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL))
  B, L, H, _ = q_BxLxHxQ.shape
  acc = ring_lib.empty_acc(B, H, L, kvb["v_b"].shape[-1])
  acc = ring_lib.online_update(acc, q_BxLxHxQ, kv, kvb, seg_BxL, idx_BxL, scale, ring_lib.tiling(block, False))
  return tiled.finish(acc, q_BxLxHxQ.dtype)[0]


def _check_length(L: int, multiple: int, n: int) -> None:
  if L % multiple:
    raise ValueError(f"Sequence length {L} is not divisible by {multiple} (context axis size {n}"
                     f"{', times 2 for the zig-zag ring' if multiple != n else ''})")


def ring_attention(q_BxLxHxQ: jax.Array, c_BxLxC: jax.Array, kr_BxLxR: jax.Array, segment_ids_BxL: jax.Array,
                   index_BxL: jax.Array, kvb: dict, scale: float, block: int = 512) -> jax.Array:
  """Ring attention over the `context` axis of the current mesh → [B, L, H, Dv] (global shapes; ring_attention.py).

  Args:
    q_BxLxHxQ: queries (nope then rotated rope part), in the zig-zag layout like every other sequence input.
    c_BxLxC: the normed KV latent; kr_BxLxR: the rotated shared rope key.
    segment_ids_BxL: packing segments (keys are visible only within the query's segment).
    index_BxL: each token's original index in the row (for causality after the zig-zag permutation).
    kvb: {"k_b": [C, H, Qn], "v_b": [C, H, Dv]} expansion weights.
    scale: softmax scale.
    block: tile size inside each ring block (`cfg.ring_block`).
  """
  n = context_size()
  _check_length(q_BxLxHxQ.shape[1], 2 * n if n > 1 else 1, n)  # the ring works on zig-zag half chunks
  return ring_lib.ring(q_BxLxHxQ, c_BxLxC, kr_BxLxR, segment_ids_BxL, index_BxL, kvb, scale, n, block)


def allgather_attention(q_BxLxHxQ: jax.Array, c_BxLxC: jax.Array, kr_BxLxR: jax.Array, segment_ids_BxL: jax.Array,
                        index_BxL: jax.Array, kvb: dict, scale: float, block: int = 512) -> jax.Array:
  """As `ring_attention`, but all-gathers the latent KV over `context` once instead of passing it around."""
  n = context_size()
  _check_length(q_BxLxHxQ.shape[1], n, n)
  seq = P(None, AXIS)
  fn = jax.shard_map(functools.partial(_allgather_region, scale=scale, block=block), axis_names={AXIS},
                     in_specs=(seq,) * 5 + (P(),), out_specs=seq)
  with jax.named_scope("allgather_attention"):
    return fn(q_BxLxHxQ, c_BxLxC, kr_BxLxR, segment_ids_BxL, index_BxL, kvb)


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
                                                   {"k_b": p["k_b"], "v_b": p["v_b"]}, softmax_scale(cfg),
                                                   cfg.ring_block)
  return jnp.einsum("blhv,hvd->bld", out_BxLxHxDv, p["o"].astype(x_BxLxD.dtype))
