"""Our param leaves ↔ Hugging Face `DeepseekV3ForCausalLM` hub tensors: the one table loading and saving both read.

HF linears store [out, in]; ours store [in, out] with heads split out. `kv_a_proj_with_mqa` is our `kv_a` and `k_rope`
concatenated; `kv_b_proj` is `k_b` and `v_b` interleaved per head ([nope | v] for each head). Routed experts use the
per-expert hub names `mlp.experts.{e}.{gate,up,down}_proj.weight`; MTP module j is layer `num_hidden_layers + j`.

Each of our leaves has a `Source`: its leading stacked dims (layers or MTP modules, then experts) pick one hub tensor
per index, and each axis of that hub tensor holds one of our dims, or two (an outer dim and an inner one at stride
`inner`, e.g. heads x head_dim), starting at `offset`. From that description alone, `read_block` reads any rectangular
block of a leaf (a device's shard) from only the hub rows/columns it covers, and `hub_tensors` rebuilds whole hub
tensors from our leaves for saving.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import jax
import numpy as np

from composer_jax.model.config import ModelConfig
from composer_jax.model.params import abstract_params

Path = tuple[str, ...]
Index = tuple[tuple[int, int], ...]          # [start, stop) per dim of a leaf
Region = Callable[[str, tuple[tuple[int, int], ...]], np.ndarray]   # (hub name, [start, stop) per hub axis) → array


@dataclasses.dataclass(frozen=True)
class HubAxis:
  """One axis of a hub tensor: which of our (unstacked) dims it holds."""
  dims: tuple[int, ...]    # one dim, or (outer, inner) flattened outer-major
  inner: int = 0           # two dims: the hub stride of the outer dim (the inner dim's full extent in the hub)
  offset: int = 0          # hub index (within each outer step) of our inner index 0


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one of our leaves lives in the hub: `name(stack indices)` and how its block maps onto that tensor."""
  name: Callable[[tuple[int, ...]], str]
  n_stack: int
  axes: tuple[HubAxis, ...]


VECTOR = (HubAxis((0,)),)
SAME = (HubAxis((0,)), HubAxis((1,)))
TRANSPOSED = (HubAxis((1,)), HubAxis((0,)))   # ours [in, out] = hub [out, in].T


def _attn(cfg: ModelConfig) -> dict[str, tuple[str, tuple[HubAxis, ...]]]:
  Q, Qn, Dv, C = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
  heads_out = (HubAxis((1, 2), inner=Q), HubAxis((0,)))        # ours [in, H, Q] = hub [H*Q, in]
  t = {}
  if cfg.q_lora_rank is None:
    t["q"] = ("q_proj.weight", heads_out)
  else:
    t.update(q_a=("q_a_proj.weight", TRANSPOSED), q_a_norm=("q_a_layernorm.weight", VECTOR),
             q_b=("q_b_proj.weight", heads_out))
  kv_a = "kv_a_proj_with_mqa.weight"
  t.update(kv_a=(kv_a, TRANSPOSED), k_rope=(kv_a, (HubAxis((1,), offset=C), HubAxis((0,)))),
           kv_a_norm=("kv_a_layernorm.weight", VECTOR),
           k_b=("kv_b_proj.weight", (HubAxis((1, 2), inner=Qn + Dv), HubAxis((0,)))),
           v_b=("kv_b_proj.weight", (HubAxis((1, 2), inner=Qn + Dv, offset=Qn), HubAxis((0,)))),
           o=("o_proj.weight", (HubAxis((2,)), HubAxis((0, 1), inner=Dv))))   # ours [H, Dv, D] = hub [D, H*Dv]
  return {f"attn/{k}": (f"self_attn.{n}", a) for k, (n, a) in t.items()}


def _block(cfg: ModelConfig, moe: bool) -> dict[str, tuple[str, tuple[HubAxis, ...], bool]]:
  """Leaf sub-path → (hub suffix under `model.layers.{i}.`, axes, per expert)."""
  t = {k: (n, a, False) for k, (n, a) in _attn(cfg).items()}
  t["attn_norm"] = ("input_layernorm.weight", VECTOR, False)
  t["mlp_norm"] = ("post_attention_layernorm.weight", VECTOR, False)
  mlp = {k: (f"{k}_proj.weight", TRANSPOSED) for k in ("gate", "up", "down")}
  if not moe:
    t.update({f"mlp/{k}": (f"mlp.{n}", a, False) for k, (n, a) in mlp.items()})
    return t
  t["moe/router"] = ("mlp.gate.weight", TRANSPOSED, False)
  t["moe/bias"] = ("mlp.gate.e_score_correction_bias", VECTOR, False)
  t.update({f"moe/{k}": (f"mlp.experts.{{e}}.{n}", a, True) for k, (n, a) in mlp.items()})
  if cfg.n_shared_experts:
    t.update({f"moe/shared/{k}": (f"mlp.shared_experts.{n}", a, False) for k, (n, a) in mlp.items()})
  return t


def _stacked(prefix: str, first_layer: int, table: dict) -> dict[Path, Source]:
  out = {}
  for sub, (suffix, axes, per_expert) in table.items():
    def name(ix, suffix=suffix):
      return f"model.layers.{first_layer + ix[0]}." + (suffix.format(e=ix[1]) if len(ix) > 1 else suffix)
    out[(prefix, *sub.split("/"))] = Source(name, 2 if per_expert else 1, axes)
  return out


def sources(cfg: ModelConfig) -> dict[Path, Source]:
  """Every leaf of `abstract_params(cfg)` (by key path) → its `Source`."""
  fixed = lambda n: lambda ix: n
  out = {("embed",): Source(fixed("model.embed_tokens.weight"), 0, SAME),
         ("final_norm",): Source(fixed("model.norm.weight"), 0, VECTOR)}
  if not cfg.tie_word_embeddings:
    out[("lm_head",)] = Source(fixed("lm_head.weight"), 0, TRANSPOSED)
  n_dense, L = cfg.first_k_dense_replace, cfg.num_hidden_layers
  if n_dense:
    out.update(_stacked("dense_layers", 0, _block(cfg, moe=False)))
  if L > n_dense:
    out.update(_stacked("moe_layers", n_dense, _block(cfg, moe=True)))
  if cfg.num_nextn_predict_layers:
    mtp = {f"block/{k}": v for k, v in _block(cfg, moe=True).items()}
    mtp.update(enorm=("enorm.weight", VECTOR, False), hnorm=("hnorm.weight", VECTOR, False),
               eh_proj=("eh_proj.weight", TRANSPOSED, False), norm=("shared_head.norm.weight", VECTOR, False))
    out.update(_stacked("mtp", L, mtp))
  return out


def mtp_copies(cfg: ModelConfig) -> dict[str, tuple[Path, tuple[HubAxis, ...]]]:
  """Hub tensors that repeat a trunk leaf: DeepSeek-V3 checkpoints carry the shared embedding and LM head in each MTP
  layer. Saved for compatibility; on load they are optional and ignored (the trunk's copy is the one trained)."""
  head = (("embed",), SAME) if cfg.tie_word_embeddings else (("lm_head",), TRANSPOSED)
  out = {}
  for j in range(cfg.num_nextn_predict_layers):
    pre = f"model.layers.{cfg.num_hidden_layers + j}."
    out[pre + "embed_tokens.weight"] = (("embed",), SAME)
    out[pre + "shared_head.head.weight"] = head
  return out


def leaf_paths(tree) -> dict[Path, object]:
  """{key path as a tuple of dict keys: leaf}."""
  return {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# --- reading ---------------------------------------------------------------------------------------------------------


def block_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
  """A device's index (slices, as `Sharding.devices_indices_map` gives it) as [start, stop) per dim."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _hub_ranges(axis: HubAxis, block: Index) -> list[tuple[int, int]]:
  """The hub index ranges one hub axis needs for our block (one range unless an inner dim is cut)."""
  if len(axis.dims) == 1:
    a, b = block[axis.dims[0]]
    return [(axis.offset + a, axis.offset + b)]
  (oa, ob), (ia, ib) = block[axis.dims[0]], block[axis.dims[1]]
  if axis.offset == 0 and ia == 0 and ib == axis.inner:
    return [(oa * axis.inner, ob * axis.inner)]
  return [(o * axis.inner + axis.offset + ia, o * axis.inner + axis.offset + ib) for o in range(oa, ob)]


def _read_unstacked(name: str, axes: tuple[HubAxis, ...], block: Index, region: Region) -> np.ndarray:
  ranges = [_hub_ranges(a, block) for a in axes]
  if len(axes) == 1:
    x = np.concatenate([region(name, (r,)) for r in ranges[0]])
  else:
    x = np.concatenate([np.concatenate([region(name, (r0, r1)) for r1 in ranges[1]], axis=1) for r0 in ranges[0]])
  order = [d for a in axes for d in a.dims]
  x = x.reshape([block[d][1] - block[d][0] for d in order])
  return np.transpose(x, np.argsort(order))


def read_block(src: Source, block: Index, region: Region, dtype=None) -> np.ndarray:
  """Our leaf's `block` ([start, stop) per dim), read through `region` from only the hub rows/columns it covers.

  Each hub tensor's part is cast to `dtype` (if given) as it is read, so a dequantised float32 copy of the whole
  block never exists at once.
  """
  stack, inner = block[:src.n_stack], block[src.n_stack:]
  grid = list(itertools.product(*[range(a, b) for a, b in stack]))
  cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
  if not src.n_stack:
    return cast(_read_unstacked(src.name(()), src.axes, inner, region))
  out = None
  for k, ix in enumerate(grid):   # filled in place: the block's parts are never all held twice
    x = cast(_read_unstacked(src.name(ix), src.axes, inner, region))
    if out is None:
      out = np.empty((len(grid), *x.shape), x.dtype)
    out[k] = x
  return out.reshape(*[b - a for a, b in stack], *out.shape[1:])


# --- writing ---------------------------------------------------------------------------------------------------------


def _place(hub: np.ndarray, axes: tuple[HubAxis, ...], x: np.ndarray) -> None:
  """Writes our unstacked leaf block `x` (whole) into the hub tensor `hub` in place."""
  order = [d for a in axes for d in a.dims]
  x = np.transpose(x, order)
  view_shape, index, k = [], [], 0
  for a, n in zip(axes, hub.shape):
    if len(a.dims) == 1:
      view_shape.append(n)
      index.append(slice(a.offset, a.offset + x.shape[k]))
      k += 1
    else:
      view_shape += [n // a.inner, a.inner]
      index += [slice(None), slice(a.offset, a.offset + x.shape[k + 1])]
      k += 2
  hub.reshape(view_shape)[tuple(index)] = x


@dataclasses.dataclass(frozen=True)
class HubTensor:
  """One hub tensor and the leaf blocks it is assembled from: (leaf path, stack indices, axes) each."""
  shape: tuple[int, ...]
  dtype: np.dtype
  parts: tuple[tuple[Path, tuple[int, ...], tuple[HubAxis, ...]], ...]

  def assemble(self, get: Callable[[Path, tuple[int, ...]], np.ndarray]) -> np.ndarray:
    """The hub tensor, from `get(leaf path, stack indices)` (that leaf's unstacked block as numpy)."""
    hub = np.zeros(self.shape, self.dtype)
    for path, ix, axes in self.parts:
      _place(hub, axes, np.asarray(get(path, ix)))
    return hub


def _hub_extent(axes: tuple[HubAxis, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(a.offset + shape[a.dims[0]] if len(a.dims) == 1 else shape[a.dims[0]] * a.inner for a in axes)


def hub_tensors(cfg: ModelConfig, *, with_mtp_copies: bool = True) -> dict[str, HubTensor]:
  """Every hub tensor a checkpoint for `cfg` holds, with its shape, dtype and the leaf blocks that make it."""
  avals = leaf_paths(abstract_params(cfg))
  entries = [(p, s.n_stack, s.axes, s.name) for p, s in sources(cfg).items()]
  if with_mtp_copies:
    entries += [(p, 0, axes, lambda ix, n=n: n) for n, (p, axes) in mtp_copies(cfg).items()]
  acc: dict[str, list] = {}
  for path, n_stack, axes, name in entries:
    aval = avals[path]
    for ix in itertools.product(*[range(n) for n in aval.shape[:n_stack]]):
      acc.setdefault(name(ix), []).append((path, ix, axes, _hub_extent(axes, aval.shape[n_stack:]), aval.dtype))
  out = {}
  for name, parts in acc.items():
    shape = tuple(max(e) for e in zip(*[p[3] for p in parts]))
    out[name] = HubTensor(shape, np.dtype(parts[0][4]), tuple(p[:3] for p in parts))
  return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every hub name a checkpoint for `cfg` holds, with its shape (abstract: nothing is allocated)."""
  return {k: v.shape for k, v in hub_tensors(cfg).items()}
