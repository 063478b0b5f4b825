"""Ring attention for MLA with a hand-written backward ring (flash-attention style): per-device memory O(L/CP).

Forward: queries stay; the latent KV block (c, kr, segment ids, original indices) hops around the `context` ring
with `lax.ppermute`, merged by an online softmax (running max and sum in float32). Only the output and its
log-sum-exp are saved. Backward: a second ring pass recomputes each block's probabilities from the saved
log-sum-exp; dq stays local, dc/dkr accumulators travel with their KV block and take one last hop home, and the
expansion weights' gradients are summed over the ring with `psum`. (Autodiff through a scanned forward ring would
instead keep every step's carries: O(L) per device.)

Layout: zig-zag (context_parallel.py). Device i holds query chunks (i, 2n-1-i). At ring step t it holds the KV of
device j = i - t (mod n), chunks (j, 2n-1-j). For j < i both query chunks see KV chunk j entirely and chunk
2n-1-j not at all: attend all queries to the first KV half. For j > i only query chunk 2n-1-i sees anything, and
it sees both KV chunks: attend the second query half to all KV. Every device does half a block per step (the
zig-zag balance); only step 0 (j = i) needs the causal diagonal. The segment/index mask is applied in every case.

Each block is attended by the tiled kernel (tiled_attention.py, tiles of `block`): scratch is one
[B, H, block, block] tile instead of the block's [B, H, L, S] logits, probabilities and their gradients; step 0
visits only the causal tile pairs (the local order is increasing in original index), and every step skips tiles
whose segment/index mask is empty (packed documents).

The regions are manual over `context` and over the mesh axes the batch is split on (`rules.current_rules()`'s
`batch`, where they divide B): each device then decides its tile skips from its own rows, and the expansion
weights' gradient is summed once per layer call, over every manual axis, at the end of the backward ring. Manual
over `context` alone, the partitioner reduced over the batch axes inside the ring: an all-reduce of every skip
decision (one per tile pair) and of each step's `k_b`/`v_b` gradient, over the `expert` axis, i.e. across nodes.
Heads sharded on `tensor` stay automatic.

Letters: B batch, L local query length, S local key length, H heads, Q query/key head dim, R rope head dim,
Dv value head dim, C kv_lora_rank, N context-parallel size (`n` in code).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from composer_jax.model import tiled_attention as tiled
from composer_jax.model.attention import expand_kv
from composer_jax.parallel.rules import current_rules, mesh_axes_dividing

AXIS = "context"


def shard_index(n: int) -> jax.Array:
  """[n] int32 0..n-1, passed into a `shard_map` over `context` with spec `P(AXIS)`: each device sees its own index.

  Used instead of `lax.axis_index`: that lowers to a PartitionId, which XLA's SPMD partitioner rejects in a
  partially manual `shard_map` inside a `lax.cond` (the RL step's unreplayed pass) and on some meshes (context=8
  with a wide expert axis). A sharded iota is partitioned like any other array, so its value is the same index.
  """
  return jnp.arange(n, dtype=jnp.int32)


def tiling(block: int, causal: bool) -> tiled.Tiling:
  """The tiling of one ring block: causal pairs only on the diagonal block, empty tiles skipped at run time."""
  return tiled.Tiling(block_q=block, block_k=block, causal_offset=0 if causal else None, skip_empty=True)


def online_update(acc, q_BxLxHxQ, kv, kvb, seg_q, idx_q, scale, tile: tiled.Tiling):
  """Folds one latent KV block (c, kr, seg, idx) into the running (out [B,H,L,Dv], max [B,H,L], sum [B,H,L])."""
  c_BxSxC, kr_BxSxR, seg_k, idx_k = kv
  k_BxSxHxQ, v_BxSxHxDv = expand_kv(kvb, c_BxSxC, kr_BxSxR)
  return tiled.fold(acc, q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, (seg_q, idx_q, seg_k, idx_k), scale, tile)


def batch_axes(B: int) -> tuple[str, ...]:
  """The automatic mesh axes of the current mesh that the rules split the batch over and that divide B."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != jax.sharding.AxisType.Manual}
  return tuple(a for a in mesh_axes_dividing("batch", B, mesh, current_rules()) if a in auto and a != AXIS)


def empty_acc(B, H, L, Dv, axes=(AXIS,)):
  """A fresh accumulator, varying over the region's manual `axes`."""
  return jax.lax.pcast(tiled.empty_acc(B, H, L, Dv), axes, to="varying")


def _split_rows(tree, half):
  """Splits every leaf [B, X, L, ...] of `tree` at query row `half` of axis 2."""
  return jax.tree.map(lambda a: a[:, :, :half], tree), jax.tree.map(lambda a: a[:, :, half:], tree)


def _fwd_region(q_BxLxHxQ, c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL, kvb, me_1, *, scale: float, n: int, block: int,
                axes: tuple[str, ...]):
  """Forward ring → (out [B, L, H, Dv], lse [B, H, L] float32; -inf for rows that see no key). me_1: [1] this
  device's index on `context` (`shard_index`); axes: the region's manual axes."""
  B, L, H, _ = q_BxLxHxQ.shape
  i, half = me_1[0], L // 2
  kv = (c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL)
  full = tiling(block, causal=False)
  acc = online_update(empty_acc(B, H, L, kvb["v_b"].shape[-1], axes), q_BxLxHxQ, kv, kvb, seg_BxL, idx_BxL, scale,
                      tiling(block, causal=True))

  def earlier(acc, kv):
    return online_update(acc, q_BxLxHxQ, tuple(a[:, :half] for a in kv), kvb, seg_BxL, idx_BxL, scale, full)

  def later(acc, kv):
    lo, hi = _split_rows(acc, half)
    hi = online_update(hi, q_BxLxHxQ[:, half:], kv, kvb, seg_BxL[:, half:], idx_BxL[:, half:], scale, full)
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=2), lo, hi)

  def step(carry):
    t, acc, kv = carry
    kv = jax.lax.ppermute(kv, AXIS, [(d, (d + 1) % n) for d in range(n)])
    return t + 1, jax.lax.cond((i - t) % n < i, earlier, later, acc, kv), kv

  # A while loop, not a scan: inside a differentiated layer scan, JAX's partial evaluation of a scan here would
  # stack every step's block probabilities as residuals (measured: 3x the step's memory), though this pass is
  # never differentiated (the custom_vjp's backward is `_bwd_region`).
  _, acc, _ = jax.lax.while_loop(lambda carry: carry[0] < n, step, (1, acc, kv))
  return tiled.finish(acc, q_BxLxHxQ.dtype)


def _block_grads(q_BxLxHxQ, dout_BxLxHxDv, lse_BxHxL, delta_BxHxL, seg_q, idx_q, kv, kvb, scale, tile):
  """Gradients of one (query rows, KV block) pair: (dq [B,L,H,Q], dkvb, dc [B,S,C], dkr [B,S,R]), float32."""
  c_BxSxC, kr_BxSxR, seg_k, idx_k = kv
  (k_BxSxHxQ, v_BxSxHxDv), expand_vjp = jax.vjp(expand_kv, kvb, c_BxSxC, kr_BxSxR)
  dq, dk, dv = tiled.block_grads(q_BxLxHxQ, k_BxSxHxQ, v_BxSxHxDv, (seg_q, idx_q, seg_k, idx_k), dout_BxLxHxDv,
                                 lse_BxHxL, delta_BxHxL, scale, tile)
  dkvb, dc, dkr = expand_vjp((dk.astype(k_BxSxHxQ.dtype), dv.astype(v_BxSxHxDv.dtype)))
  f32 = jnp.float32
  return dq, jax.tree.map(lambda a: a.astype(f32), dkvb), dc.astype(f32), dkr.astype(f32)


def _bwd_region(q_BxLxHxQ, c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL, kvb, out_BxLxHxDv, lse_BxHxL, dout_BxLxHxDv, me_1,
                *, scale: float, n: int, block: int, axes: tuple[str, ...]):
  """Backward ring → (dq, dc, dkr, dkvb summed over the ring and the batch shards)."""
  L = q_BxLxHxQ.shape[1]
  i, half = me_1[0], L // 2
  weights = kvb
  # Varying copies: their per-device gradients accumulate locally and are summed once at the end (through the
  # replicated originals, autodiff would insert a psum at every step).
  kvb = jax.lax.pcast(kvb, axes, to="varying")
  delta_BxHxL = tiled.delta_rows(dout_BxLxHxDv, out_BxLxHxDv)
  rows = (q_BxLxHxQ, dout_BxLxHxDv, lse_BxHxL, delta_BxHxL, seg_BxL, idx_BxL)
  kv = (c_BxSxC, kr_BxSxR, seg_BxL, idx_BxL)
  full = tiling(block, causal=False)
  dq, dkvb, dc, dkr = _block_grads(*rows, kv, kvb, scale, tiling(block, causal=True))

  def earlier(grads, kv):  # all queries x first KV half
    dq, dkvb, dc, dkr = grads
    g = _block_grads(*rows, tuple(a[:, :half] for a in kv), kvb, scale, full)
    return (dq + g[0], jax.tree.map(jnp.add, dkvb, g[1]), dc.at[:, :half].add(g[2]), dkr.at[:, :half].add(g[3]))

  def later(grads, kv):  # second query half x all KV
    dq, dkvb, dc, dkr = grads
    hi = tuple(a[:, half:] for a in rows[:2]) + tuple(a[:, :, half:] for a in rows[2:4]) + tuple(
        a[:, half:] for a in rows[4:])
    g = _block_grads(*hi, kv, kvb, scale, full)
    return (dq.at[:, half:].add(g[0]), jax.tree.map(jnp.add, dkvb, g[1]), dc + g[2], dkr + g[3])

  ring = [(d, (d + 1) % n) for d in range(n)]

  def step(carry, t):
    (dq, dkvb, dc, dkr), kv = carry
    kv, dc, dkr = jax.lax.ppermute((kv, dc, dkr), AXIS, ring)  # a block's gradient travels with it
    return (jax.lax.cond((i - t) % n < i, earlier, later, (dq, dkvb, dc, dkr), kv), kv), None

  ((dq, dkvb, dc, dkr), _), _ = jax.lax.scan(step, ((dq, dkvb, dc, dkr), kv), jnp.arange(1, n))
  if n > 1:  # device i now holds the gradient of device i+1's block: one last hop home
    dc, dkr = jax.lax.ppermute((dc, dkr), AXIS, ring)
  dkvb = jax.tree.map(lambda g, w: jax.lax.psum(g, axes).astype(w.dtype), dkvb, weights)
  return dq.astype(q_BxLxHxQ.dtype), dc.astype(c_BxSxC.dtype), dkr.astype(kr_BxSxR.dtype), dkvb


def _specs(B: int):
  """(manual axes, [B, L, ...] spec, [B, H, L] spec) of the regions for a batch of B rows."""
  b = batch_axes(B)
  rows = b[0] if len(b) == 1 else (b or None)
  return (AXIS, *b), P(rows, AXIS), P(rows, None, AXIS)


def _fwd_call(q, c, kr, seg, idx, kvb, scale, n, block):
  axes, seq, lse = _specs(q.shape[0])
  fn = jax.shard_map(functools.partial(_fwd_region, scale=scale, n=n, block=block, axes=axes),
                     axis_names=set(axes), in_specs=(seq,) * 5 + (P(), P(AXIS)), out_specs=(seq, lse))
  with jax.named_scope("ring_attention_fwd"):
    return fn(q, c, kr, seg, idx, kvb, shard_index(n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def ring(q_BxLxHxQ, c_BxLxC, kr_BxLxR, seg_BxL, idx_BxL, kvb, scale: float, n: int, block: int):
  """Ring attention on global arrays in the zig-zag layout → [B, L, H, Dv] (see `context.ring_attention`); each
  block tiled in `block` x `block` tiles."""
  return _fwd_call(q_BxLxHxQ, c_BxLxC, kr_BxLxR, seg_BxL, idx_BxL, kvb, scale, n, block)[0]


def _ring_fwd(q, c, kr, seg, idx, kvb, scale, n, block):
  out, lse = _fwd_call(q, c, kr, seg, idx, kvb, scale, n, block)
  # Named so that a remat policy can keep them (remat.REMAT_POLICIES "save_attention"): with both saved, the
  # backward needs nothing else from the forward ring, so a rematerialised layer does not run the ring again.
  out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
  return out, (q, c, kr, seg, idx, kvb, out, lse)


def _ring_bwd(scale, n, block, res, dout):
  q, c, kr, seg, idx, kvb, out, lse = res
  axes, seq, lse_spec = _specs(q.shape[0])
  fn = jax.shard_map(functools.partial(_bwd_region, scale=scale, n=n, block=block, axes=axes),
                     axis_names=set(axes), in_specs=(seq,) * 5 + (P(), seq, lse_spec, seq, P(AXIS)),
                     out_specs=(seq, seq, seq, P()))
  with jax.named_scope("ring_attention_bwd"):
    dq, dc, dkr, dkvb = fn(q, c, kr, seg, idx, kvb, out, lse, dout, shard_index(n))
  return dq, dc, dkr, None, None, dkvb


ring.defvjp(_ring_fwd, _ring_bwd)
