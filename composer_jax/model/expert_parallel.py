"""Expert parallelism: a MoE layer's routed experts inside `jax.shard_map` over the mesh's `expert` axis.

Tokens are split over the batch axes *and* `expert` (and `seq` over `context`), experts over `expert`. Each device
sends copies of its tokens to the devices owning their chosen experts (all-to-all), runs its local experts, sends
the results back (all-to-all) and combines them with the gate weights. Two variants (`cfg.moe_impl`):

- `ep_capacity`: fixed [E, Ce, D] send buffers, Ce = ceil(capacity_factor * t * K / E) slots per (source device,
  expert), exchanged with `lax.all_to_all` (runs on every backend, XLA:CPU included). Assignments past Ce are
  dropped: the token keeps the shared expert and the residual, and `dropped_fraction` counts them.
- `ep_ragged`: assignments sorted by expert are exchanged with `lax.ragged_all_to_all` (GPU/TPU only; XLA:CPU
  does not implement it) and computed with grouped matmuls (`experts.expert_matmul`); only real rows travel. The
  receive buffer has the worst-case N * t * K rows (dropless by construction; memory grows with N), or with
  `cfg.ragged_buffer_factor` f > 0, ceil(f * t * K) rows: rows past it are cut (`ragged_plan`) and counted in
  `dropped_fraction` (of all assignments, padding included), dropless whenever no device receives more.

Expert weights FSDP-sharded over token axes (`ShardingRules.expert_embed`, e.g. data x context) enter the region in
that layout and are all-gathered inside it (`_gather_weights`), so their gradients leave through the transposed
collective, a reduce-scatter, instead of being gathered at the region's boundary and all-reduced in full.

The mesh comes from the context (`jax.set_mesh(mesh)` around the jitted call; `get_abstract_mesh()` inside) or is
passed explicitly. There is no silent fallback: an `ep_*` impl without a mesh is an error, and a mesh whose
`expert` axis has size 1 runs the same code with no-op collectives.

Letters: B batch, L length, D hidden, E routed experts, K experts per token, F expert ffw, N expert-axis size,
X = E / N experts per device, b, l local batch and length, t = b*l local tokens, m = t*K local assignments,
Ce slots per (source device, expert), R = N*m receive rows (dropless).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from composer_jax.model.config import ModelConfig
from composer_jax.model.experts import capacity, capacity_dispatch, combine_rows, expert_matmul, slot_rows
from composer_jax.parallel.rules import ShardingRules, current_rules

EP_IMPLS = ("ep_capacity", "ep_ragged")
AXIS = "expert"


def ambient_mesh():
  """The mesh set with `jax.set_mesh`, or a clear error naming what is missing."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError("expert parallelism (moe_impl='ep_capacity'/'ep_ragged') needs a mesh: call the model under "
                     "`with jax.set_mesh(mesh):` (composer_jax.parallel.make_mesh), or use moe_impl='capacity'/"
                     "'ragged' on one device")
  return mesh


def _present(axes: tuple[str, ...], mesh) -> tuple[str, ...]:
  return tuple(a for a in axes if a in mesh.shape)


def region_axes(mesh, rules: ShardingRules) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
  """Mesh axes of the EP region: tokens' batch (always including `expert`), tokens' length, experts' F.

  Raises:
    ValueError: if the mesh has no `expert` axis, experts are not mapped to it, or token and ffw axes collide.
  """
  if AXIS not in mesh.shape:
    raise ValueError(f"expert parallelism needs a mesh axis {AXIS!r}; mesh axes are {tuple(mesh.shape)}")
  if rules.mesh_axes("experts") != (AXIS,):
    raise ValueError(f"expert parallelism shards experts over {AXIS!r}, but ShardingRules.experts="
                     f"{rules.experts!r}")
  batch = _present(rules.mesh_axes("batch"), mesh)
  batch = batch if AXIS in batch else (*batch, AXIS)
  seq = _present(rules.mesh_axes("seq"), mesh)
  ffw = _present(rules.mesh_axes("expert_ffw"), mesh)
  clash = (set(batch) | set(seq)) & set(ffw) or set(batch) & set(seq)
  if clash:
    raise ValueError(f"mesh axes {sorted(clash)} are used twice in the EP region (batch={batch}, seq={seq}, "
                     f"expert_ffw={ffw}); change ShardingRules")
  return batch, seq, ffw


def _check_divides(name: str, size: int, axes: tuple[str, ...], mesh) -> None:
  n = math.prod(mesh.shape[a] for a in axes)
  if size % n:
    raise ValueError(f"expert parallelism: {name}={size} is not divisible by mesh axes {axes} (size {n})")


def expert_parallel(p: dict, x_BxLxD: jax.Array, experts_BxLxK: jax.Array, w_BxLxK: jax.Array, valid_BxL: jax.Array,
                    cfg: ModelConfig, *, mesh=None, rules: ShardingRules | None = None,
                    ragged_all_to_all=jax.lax.ragged_all_to_all) -> tuple[jax.Array, jax.Array]:
  """Routed experts with expert parallelism (`cfg.moe_impl` picks the variant).

  Args:
    p: the layer's `moe` params (gate/up [E, D, F], down [E, F, D]).
    x_BxLxD: normed input.
    experts_BxLxK: chosen (or replayed) experts.
    w_BxLxK: their gate weights.
    valid_BxL: non-padding tokens (padding takes no capacity slot).
    cfg: model config; `moe_impl` in `EP_IMPLS`.
    mesh: the mesh (default: the context mesh from `jax.set_mesh`).
    rules: logical→mesh table (default `parallel.rules.current_rules()`); `batch`/`seq` give the token split,
      `expert_ffw` a tensor-parallel split of each expert's F (partial outputs summed with `psum`), `expert_embed`
      the FSDP split of each expert's D (gathered inside the region over the token axes it names).
    ragged_all_to_all: the dropless collective; tests pass `ragged_all_to_all_reference` to run on CPU.

  Returns:
    (routed output [B, L, D] without the shared expert, fraction of assignments dropped).
  """
  mesh = ambient_mesh() if mesh is None else mesh
  rules = current_rules() if rules is None else rules
  batch, seq, ffw = region_axes(mesh, rules)
  tok = P(batch, seq or None)
  B, L, _ = x_BxLxD.shape
  E = p["gate"].shape[0]
  _check_divides("batch", B, batch, mesh)
  _check_divides("length", L, seq, mesh)
  _check_divides("n_routed_experts", E, (AXIS,), mesh)
  _check_divides("moe_intermediate_size", p["gate"].shape[2], ffw, mesh)
  ffw_spec = ffw or None
  # FSDP axes of the experts' D that tokens are split over: gathered in the region (over any other axis the
  # partitioner gathers at the boundary; every device there holds the same tokens, so that gradient is a slice).
  emb = tuple(a for a in _present(rules.mesh_axes("expert_embed"), mesh) if a in batch + seq and mesh.shape[a] > 1)
  _check_divides("hidden_size (expert_embed)", p["gate"].shape[1], emb, mesh)
  emb_spec = emb or None
  w_specs = (P(AXIS, emb_spec, ffw_spec), P(AXIS, emb_spec, ffw_spec), P(AXIS, ffw_spec, emb_spec))
  if cfg.moe_impl == "ep_capacity":
    if cfg.ep_dispatch not in ("compute", "fp8"):
      raise ValueError(f"ep_dispatch={cfg.ep_dispatch!r}; valid: 'compute', 'fp8'")
    body = functools.partial(_capacity_body, cap_factor=cfg.capacity_factor, token_axes=(*batch, *seq),
                             ffw_axes=ffw, fp8_dispatch=cfg.ep_dispatch == "fp8")
  elif cfg.moe_impl == "ep_ragged":
    body = functools.partial(_ragged_body, cfg=cfg, token_axes=(*batch, *seq), ffw_axes=ffw,
                             ragged_all_to_all=ragged_all_to_all)
  else:
    raise ValueError(f"moe_impl={cfg.moe_impl!r} is not an expert-parallel impl; valid: {EP_IMPLS}")
  dt = x_BxLxD.dtype
  body = functools.partial(_gather_weights, body=body, emb_axes=emb)
  region = jax.shard_map(body, mesh=mesh, in_specs=(*w_specs, tok, tok, tok, tok), out_specs=(tok, P()))
  with jax.named_scope(cfg.moe_impl):
    return region(p["gate"].astype(dt), p["up"].astype(dt), p["down"].astype(dt), x_BxLxD, experts_BxLxK, w_BxLxK,
                  valid_BxL)


def _gather_weights(gate_XxDxF, up_XxDxF, down_XxFxD, *tokens, body, emb_axes):
  """All-gathers the local experts' FSDP-split D (once per layer call; the transpose reduce-scatters the
  gradients), then runs the region's body."""
  if emb_axes:
    gate_XxDxF, up_XxDxF = (jax.lax.all_gather(w, emb_axes, axis=1, tiled=True) for w in (gate_XxDxF, up_XxDxF))
    down_XxFxD = jax.lax.all_gather(down_XxFxD, emb_axes, axis=2, tiled=True)
  return body(gate_XxDxF, up_XxDxF, down_XxFxD, *tokens)


def _ffn(h_in, gate, up, down, mm, ffw_axes):
  """SwiGLU expert FFN with one matmul function for all three products; F may be split over `ffw_axes`."""
  y = mm(jax.nn.silu(mm(h_in, gate)) * mm(h_in, up), down)
  return jax.lax.psum(y, ffw_axes) if ffw_axes else y


def dispatch(x_txD, expert_m, valid_m, n_experts: int, cap: int, fp8: bool = False):
  """Local slots, then all-to-all: returns (received [N, X, Ce, D] by source device, slot [m], kept [m]).

  With `fp8` the slots travel as float8_e4m3fn with one float32 scale per slot (`fp8_all_to_all`)."""
  N = jax.lax.axis_size(AXIS)
  buf_ExCexD, slot_m, keep_m = capacity_dispatch(x_txD, expert_m, valid_m, n_experts, cap)
  send_NxXxCexD = buf_ExCexD.reshape(N, n_experts // N, cap, x_txD.shape[1])
  exchange = fp8_all_to_all if fp8 else functools.partial(jax.lax.all_to_all, axis_name=AXIS, split_axis=0,
                                                          concat_axis=0, tiled=True)
  return exchange(send_NxXxCexD), slot_m, keep_m


FP8_MAX = 448.0   # largest finite float8_e4m3fn


@jax.custom_vjp
def fp8_all_to_all(x_NxXxCexD):
  """The dispatch all-to-all with each slot (a token's D values) sent as e4m3 times a float32 scale
  (max |x| / 448): about half the bytes of bf16. The backward sends the cotangent back in its own dtype
  (straight-through: the quantisation's rounding is not differentiated), as DeepSeek-V3 keeps its combine in bf16."""
  scale_NxXxCex1 = jnp.maximum(jnp.max(jnp.abs(x_NxXxCexD.astype(jnp.float32)), -1, keepdims=True) / FP8_MAX,
                               jnp.finfo(jnp.float32).tiny)
  q = (x_NxXxCexD.astype(jnp.float32) / scale_NxXxCex1).astype(jnp.float8_e4m3fn)
  q, scale_NxXxCex1 = (jax.lax.all_to_all(a, AXIS, 0, 0, tiled=True) for a in (q, scale_NxXxCex1))
  return (q.astype(jnp.float32) * scale_NxXxCex1).astype(x_NxXxCexD.dtype)


def _fp8_all_to_all_fwd(x_NxXxCexD):
  return fp8_all_to_all(x_NxXxCexD), None


def _fp8_all_to_all_bwd(_, g_NxXxCexD):
  # The transpose of a tiled all-to-all over dim 0 is the same all-to-all.
  return (jax.lax.all_to_all(g_NxXxCexD, AXIS, 0, 0, tiled=True),)


fp8_all_to_all.defvjp(_fp8_all_to_all_fwd, _fp8_all_to_all_bwd)


def return_to_sources(y_NxXxCexD):
  """The inverse all-to-all: each source device gets its [E, Ce, D] slots back."""
  N, X, Ce, D = y_NxXxCexD.shape
  return jax.lax.all_to_all(y_NxXxCexD, AXIS, 0, 0, tiled=True).reshape(N * X, Ce, D)


def _capacity_body(gate_XxDxF, up_XxDxF, down_XxFxD, x_bxlxD, experts_bxlxK, w_bxlxK, valid_bxl, *, cap_factor,
                   token_axes, ffw_axes, fp8_dispatch=False):
  b, l, D = x_bxlxD.shape
  K = experts_bxlxK.shape[-1]
  X = gate_XxDxF.shape[0]
  N = jax.lax.axis_size(AXIS)
  t = b * l
  E = N * X
  Ce = capacity(cap_factor, t, K, E)
  valid_m = jnp.repeat(valid_bxl.reshape(t), K)
  recv_NxXxCexD, slot_m, keep_m = dispatch(x_bxlxD.reshape(t, D), experts_bxlxK.reshape(-1), valid_m, E, Ce,
                                           fp8=fp8_dispatch)
  rows_XxRxD = recv_NxXxCexD.transpose(1, 0, 2, 3).reshape(X, N * Ce, D)
  mm = functools.partial(jnp.einsum, "erd,edf->erf")
  y_XxRxD = _ffn(rows_XxRxD, gate_XxDxF, up_XxDxF, down_XxFxD, mm, ffw_axes)
  y_ExCexD = return_to_sources(y_XxRxD.reshape(X, N, Ce, D).transpose(1, 0, 2, 3))
  # Named "ep_return": a remat policy that keeps it (remat.REMAT_POLICIES) spares a rematerialised layer the return
  # exchange and the down projection before it, which the backward re-ran only to have these values for the gate
  # weights' gradient. Named per assignment ([t·K, D], the slots' rows) rather than as the exchange's [E, Ce, D]
  # result: the saved stack then holds no capacity padding (1/1.25 of the bytes at capacity factor 1.25).
  y_mxD = checkpoint_name(slot_rows(y_ExCexD, slot_m), "ep_return")
  out_txD = combine_rows(y_mxD, keep_m, w_bxlxK.reshape(-1), t)
  counts = jnp.stack([(valid_m & ~keep_m).sum(), valid_m.sum()]).astype(jnp.float32)
  n_dropped, n_valid = jax.lax.psum(counts, token_axes)
  return out_txD.reshape(b, l, D), n_dropped / jnp.maximum(n_valid, 1.0)


def _exclusive_cumsum(a, axis):
  return jnp.cumsum(a, axis=axis) - a


def ragged_buffer_rows(n_assignments: int, n_devices: int, factor: float) -> int:
  """Receive rows of `ep_ragged`: the worst case N x m (factor 0: never drops), else ceil(factor x m), m the local
  assignments (each device receives m on average)."""
  return n_devices * n_assignments if factor <= 0 else min(n_devices * n_assignments, math.ceil(factor * n_assignments))


def ragged_plan(counts_NxNxX: jax.Array, rows: int) -> dict[str, jax.Array]:
  """Where every chunk of the dropless exchange goes, given every device's counts [source, destination, X local
  experts] and a receive buffer of `rows` rows per device.

  Source s's rows for destination d are contiguous in s's expert-sorted rows (from `in_off[s, d]`) and land at d
  after every earlier source's (`out_off[s, d]`). What does not fit in d's buffer is cut: a chunk keeps its first
  `kept[s, d]` rows (its lowest local experts first) and later sources' chunks keep none, so the kept rows fill d's
  buffer from row 0 without gaps. `kept_NxNxX[s, d, x]` counts the kept rows of local expert x.
  """
  sent_NxN = counts_NxNxX.sum(-1)
  out_off_NxN = _exclusive_cumsum(sent_NxN, 0)
  kept_NxN = jnp.clip(rows - out_off_NxN, 0, sent_NxN)
  start_NxNxX = _exclusive_cumsum(counts_NxNxX, 2)   # where each local expert's rows start inside its chunk
  return {"in_off": _exclusive_cumsum(sent_NxN, 1), "out_off": out_off_NxN, "sent": sent_NxN, "kept": kept_NxN,
          "kept_NxNxX": jnp.clip(kept_NxN[..., None] - start_NxNxX, 0, counts_NxNxX)}


def _ragged_body(gate_XxDxF, up_XxDxF, down_XxFxD, x_bxlxD, experts_bxlxK, w_bxlxK, valid_bxl, *, cfg, token_axes,
                 ffw_axes, ragged_all_to_all):
  del valid_bxl  # padding tokens are computed like the single-device ragged path does
  b, l, D = x_bxlxD.shape
  K = experts_bxlxK.shape[-1]
  X = gate_XxDxF.shape[0]
  N = jax.lax.axis_size(AXIS)
  me = jax.lax.axis_index(AXIS)
  t, m = b * l, b * l * K
  expert_m = experts_bxlxK.reshape(m)
  order_m = jnp.argsort(expert_m, stable=True)  # by global expert = by owning device, then local expert
  token_m = order_m // K
  xs_mxD = x_bxlxD.reshape(t, D)[token_m]
  sizes_NxX = jnp.bincount(expert_m, length=N * X).astype(jnp.int32).reshape(N, X)
  # Every device's per-(destination, local expert) counts: [source, destination, X]. Tiny (N*N*X ints).
  R = ragged_buffer_rows(m, N, cfg.ragged_buffer_factor)
  plan = ragged_plan(jax.lax.all_gather(sizes_NxX, AXIS), R)
  in_off, out_off, kept = plan["in_off"], plan["out_off"], plan["kept"]
  recv_RxD = ragged_all_to_all(xs_mxD, jnp.zeros((R, D), xs_mxD.dtype), in_off[me], kept[me], out_off[me],
                               kept[:, me], axis_name=AXIS)
  # Received rows are grouped by source, then by local expert: regroup by local expert for the grouped matmul.
  counts_flat = plan["kept_NxNxX"][:, me, :].reshape(N * X)
  ends = jnp.cumsum(counts_flat)
  seg_R = jnp.searchsorted(ends, jnp.arange(R, dtype=ends.dtype), side="right")  # N*X for unused rows
  local_R = jnp.where(seg_R < N * X, seg_R % X, X)
  order_R = jnp.argsort(local_R, stable=True)
  group_X = plan["kept_NxNxX"][:, me, :].sum(0)
  mm = functools.partial(expert_matmul, group_sizes_E=group_X, cfg=cfg)
  y_sorted_RxD = _ffn(recv_RxD[order_R], gate_XxDxF, up_XxDxF, down_XxFxD, mm, ffw_axes)
  y_RxD = jnp.zeros_like(y_sorted_RxD).at[order_R].set(y_sorted_RxD)
  # Rows cut from the buffer are never sent back: they stay zero, as a dropped capacity slot contributes nothing.
  back_mxD = checkpoint_name(ragged_all_to_all(y_RxD, jnp.zeros((m, D), y_RxD.dtype), out_off[:, me], kept[:, me],
                                               in_off[:, me], kept[me], axis_name=AXIS), "ep_return")
  ys_mxD = back_mxD * w_bxlxK.reshape(m)[order_m][:, None].astype(back_mxD.dtype)
  out_txD = jnp.zeros((t, D), ys_mxD.dtype).at[token_m].add(ys_mxD)
  counts = jnp.stack([(plan["sent"][me] - kept[me]).sum(), m]).astype(jnp.float32)
  n_dropped, n_all = jax.lax.psum(counts, token_axes)
  return out_txD.reshape(b, l, D), n_dropped / n_all


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
  """`lax.ragged_all_to_all` from padded `lax.all_to_all`s: the readable (N times larger) reference for CPU.

  Device i sends rows input_offsets[j] : +send_sizes[j] of `operand` to device j, where they are written at
  output_offsets[j] of j's `output`; recv_sizes[i] on j is what i sends. Other rows of `output` are kept.
  """
  M, D = operand.shape
  r_M = jnp.arange(M)
  src_NxM = jnp.clip(input_offsets[:, None] + r_M[None], 0, M - 1)
  send_NxMxD = jnp.where((r_M[None] < send_sizes[:, None])[..., None], operand[src_NxM], 0)
  recv_NxMxD = jax.lax.all_to_all(send_NxMxD, axis_name, 0, 0, tiled=True)
  recv_off_N = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dst_NxM = jnp.where(r_M[None] < recv_sizes[:, None], recv_off_N[:, None] + r_M[None], output.shape[0])
  return output.at[dst_NxM.reshape(-1)].set(recv_NxMxD.reshape(-1, D), mode="drop")
