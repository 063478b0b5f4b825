"""The pure language-model training step (pretraining, long-context and SFT stages share it).

`train_step(state, batch) -> (state, metrics)` is built by `make_train_step`, jitted with explicit shardings and
the state donated. In a notebook, `jax.jit(functools.partial(train_step, ...))` on `init_state(model.init(...), opt)`
compiles once too: `init_state` places every leaf where the jitted step hands it back. The loss runs the chunked
LM head (`model.head`): no [B, L, V] logits, in the forward or the backward.

Shapes: B batch, L length, D hidden, V vocab, E experts, Lm MoE layers.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from composer_jax import model
from composer_jax.model import head
from composer_jax.model.config import ModelConfig
from composer_jax.parallel.rules import current_rules, use_rules
from composer_jax.train import checkpoint as ckpt_lib
from composer_jax.train import losses, optim
from composer_jax.train.config import TrainConfig


@functools.partial(jax.tree_util.register_dataclass, data_fields=["step", "params", "opt_state"], meta_fields=[])
@dataclasses.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState


def canonical_sharding(sharding: NamedSharding) -> NamedSharding:
  """The same layout spelled as XLA hands it back: size-1 mesh axes and trailing replicated dims left out.

  `P('data', 'tensor')` on a mesh whose `tensor` axis has size 1 is `P('data')` to XLA, and a jitted function returns
  its outputs spelled that way; jit keys its cache on the spelling, so an input spelled otherwise compiles again.
  """
  mesh = sharding.mesh

  def entry(e):
    kept = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if mesh.shape[a] > 1)
    return None if not kept else kept[0] if len(kept) == 1 else kept

  spec = [entry(e) for e in sharding.spec]
  while spec and spec[-1] is None:
    spec.pop()
  return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def _split_further(sharding: NamedSharding, shape, axes: tuple[str, ...]) -> NamedSharding:
  """`sharding` with `axes` (those in the mesh, size > 1, not used yet) added to the first dimension whose size
  they divide together with what already splits it (ZeRO-1 for a moment of a replicated or FSDP param)."""
  mesh, spec = sharding.mesh, list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  used = {a for e in spec for a in ((e,) if isinstance(e, str) else e or ())}
  extra = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
  if not extra:
    return sharding
  n_extra = 1
  for a in extra:
    n_extra *= mesh.shape[a]
  for i, (dim, e) in enumerate(zip(shape, spec)):
    have = (e,) if isinstance(e, str) else tuple(e or ())
    n = n_extra
    for a in have:
      n *= mesh.shape[a]
    if dim % n == 0:
      spec[i] = have + extra if len(have + extra) > 1 else extra[0]
      return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)
  return sharding


def state_shardings(optimizer: optax.GradientTransformation, abstract_params, params_shardings,
                    zero1_axes: tuple[str, ...] = ()) -> TrainState:
  """Shardings of a TrainState (nothing is allocated): params as given, every optimizer leaf that mirrors a param
  (Adam's moments: its tree path ends with that param's path and the shapes agree) as that param, split further
  over `zero1_axes` (ZeRO-1: `ShardingRules.optimizer_state`; XLA then reduce-scatters the gradients into the
  update and all-gathers the new params), the rest (step, counts) replicated.

  Read off the paths rather than a compiled initialiser: XLA is free to replicate `zeros_like(p)` (it did, for
  the moments of FSDP-sharded params).
  """
  by_path = {jax.tree_util.keystr(p): (s, x.shape) for (p, s), x in zip(
      jax.tree_util.tree_flatten_with_path(params_shardings)[0], jax.tree.leaves(abstract_params))}
  replicated = NamedSharding(next(iter(by_path.values()))[0].mesh, PartitionSpec())

  def mirror(path, x):
    for i in range(len(path)):                       # longest suffix first
      s, shape = by_path.get(jax.tree_util.keystr(path[i:]), (None, None))
      if s is not None and shape == x.shape:
        return _split_further(s, x.shape, zero1_axes)
    return replicated
  abstract = jax.eval_shape(lambda p: init_state(p, optimizer), abstract_params)
  return TrainState(step=replicated, params=params_shardings,
                    opt_state=jax.tree_util.tree_map_with_path(mirror, abstract.opt_state))


def _concrete_shardings(params):
  """The shardings of concrete params on a mesh, or None (traced, host arrays, or single-device arrays)."""
  leaves = jax.tree.leaves(params)
  if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and isinstance(x.sharding, NamedSharding)
         for x in leaves) and leaves:
    return jax.tree.map(lambda x: x.sharding, params)
  return None


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  """The step-0 state of `params`.

  On concrete params on a mesh (`model.init`'s), every leaf comes out where a jitted step returns it: the
  `state_shardings` layouts, spelled as XLA spells them (`canonical_sharding`), so `jax.jit(train_step)` without
  explicit shardings compiles once instead of again on its second call. (On a multi-device mesh, jit the step with
  the state's shardings — `make_train_step` — since without them XLA may choose other layouts for its outputs.)
  Traced (under `jit` / `eval_shape`) or on host arrays it is the plain state.
  """
  params_shardings = _concrete_shardings(params)
  if params_shardings is None:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
  shardings = jax.tree.map(canonical_sharding, state_shardings(optimizer, params, params_shardings))
  # Built by one jitted program (traced, this function is the plain state): the moments are created in place, and
  # the params are copied, so donating the state later never frees buffers the caller's `params` still hold.
  return jax.jit(lambda p: init_state(p, optimizer), out_shardings=shardings)(params)


def fresh_state(params, optimizer: optax.GradientTransformation, shardings: TrainState) -> TrainState:
  """The step-0 state of `params`, built by one jitted program directly on `shardings`."""
  return jax.jit(lambda p: init_state(p, optimizer), out_shardings=shardings)(params)


def abstract_state(abstract_params, optimizer: optax.GradientTransformation, shardings: TrainState) -> TrainState:
  """The state's shapes and dtypes on `shardings` (ShapeDtypeStructs): what a checkpoint is restored onto."""
  return ckpt_lib.abstract_like(jax.eval_shape(lambda: init_state(abstract_params, optimizer)), shardings)


def start_state(checkpointer: ckpt_lib.Checkpointer, optimizer: optax.GradientTransformation, shardings: TrainState,
                abstract_params, init_params: Callable[[], dict], data_iter=None) -> TrainState:
  """A run's state on `shardings`, as the LM loop and the RL trainer both start: restored from `checkpointer`'s
  newest checkpoint (with `data_iter`, restored in place), else the step-0 state of `init_params()` (called only
  then, so a resumed run builds no fresh params)."""
  if checkpointer.latest_step() is None:
    return fresh_state(init_params(), optimizer, shardings)
  abstract = abstract_state(abstract_params, optimizer, shardings)
  return checkpointer.restore(abstract, data_iter)


def loss_fn(params, batch, model_cfg: ModelConfig, train_cfg: TrainConfig):
  """Total loss and its parts. The MTP modules see a detached trunk (and head) in self-distillation mode, and do
  not run at all with mtp_loss="none"."""
  tokens, seg, mask = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
  detach = train_cfg.mtp_loss == "self_distill"
  fwd_cfg = model_cfg if train_cfg.mtp_loss != "none" else dataclasses.replace(model_cfg, num_nextn_predict_layers=0)
  h, aux = model.hidden_states(params, tokens, fwd_cfg, segment_ids=seg, positions=batch["positions"],
                               mtp_detach_trunk=detach)
  w = model.lm_head(params, model_cfg)
  targets, tmask = losses.shifted_targets(tokens, seg, mask, 1)
  ce, n_tokens = head.cross_entropy(h, w, targets, tmask)
  total = ce + aux["balance_loss"]
  metrics = {"ce": ce, "balance_loss": aux["balance_loss"], "target_tokens": n_tokens}
  n_mtp = aux["mtp_hidden"].shape[0]
  if n_mtp and train_cfg.mtp_loss != "none":
    mtp, agree = losses.mtp_losses(h, aux["mtp_hidden"], w, model.lm_head(params, model_cfg, detach=detach), tokens,
                                   seg, mask, train_cfg.mtp_loss)
    total = total + train_cfg.mtp_weight * jnp.mean(mtp)
    for k in range(n_mtp):
      metrics[f"mtp{k + 1}_loss"] = mtp[k]
      metrics[f"mtp{k + 1}_agreement"] = agree[k]
  metrics["loss"] = total
  return total, (metrics, aux)


def update_router_bias(params, loads: dict, rate: float):
  """DeepSeek-V3 aux-loss-free balancing: b_i += γ·sign(mean load − load_i), outside the gradient.

  Args:
    params: the model params; every router correction bias (`.../moe/bias`, [Lm, E]) under a top-level key of
      `loads` is updated.
    loads: top-level param key → tokens per expert [Lm, E] for that stack (`moe_layers` ← aux["expert_load"],
      `mtp` ← aux["mtp_expert_load"]). Experts never chosen are pushed up, overloaded ones down.
    rate: γ (0 disables the update).
  """
  if rate == 0.0:
    return params

  def upd(path, x):
    top = str(getattr(path[0], "key", path[0]))
    if not optim.is_router_bias(path) or top not in loads:
      return x
    load = loads[top]
    if load.shape != x.shape:
      raise ValueError(f"Expert load {load.shape} does not match router bias {x.shape} at {top}")
    return x + (rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)).astype(x.dtype)
  return jax.tree_util.tree_map_with_path(upd, params)


def _global_norm(tree):
  return optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32), tree))


def update_metrics(grads, updates, params, expert_load_LmxE: jax.Array) -> dict:
  """What every trainer logs about an update: grad / update / param norms and the per-layer max/mean expert load."""
  metrics = {"grad_norm": _global_norm(grads), "update_norm": _global_norm(updates), "param_norm": _global_norm(params)}
  if expert_load_LmxE.shape[0]:
    ratio = jnp.max(expert_load_LmxE, -1) / jnp.maximum(jnp.mean(expert_load_LmxE, -1), 1e-9)
    metrics.update(expert_load_max_over_mean=jnp.mean(ratio), expert_load_max_over_mean_worst=jnp.max(ratio))
  return metrics


def train_step(state: TrainState, batch, *, model_cfg, train_cfg, optimizer, grad_shardings=None):
  """One optimizer step; returns the new state and scalar metrics.

  `grad_shardings` (the params' shardings; `make_train_step` passes them) pins the gradients to the params'
  layout: with ZeRO-1 moments split further, the partitioner otherwise carried the moments' layout back into the
  backward scan and summed every layer's dense-weight gradients over all devices inside the loop (on the 256-device
  Kimi K2 plan, 24 GB more per step over InfiniBand than reducing them in the params' layout)."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (_, (metrics, aux)), grads = grad_fn(state.params, batch, model_cfg, train_cfg)
  if grad_shardings is not None:
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  loads = {"moe_layers": aux["expert_load"]}
  if aux["mtp_expert_load"].shape[0]:   # the MTP modules ran (not with mtp_loss='none')
    loads["mtp"] = aux["mtp_expert_load"]
  params = update_router_bias(params, loads, train_cfg.bias_update_rate)
  metrics.update(update_metrics(grads, updates, params, aux["expert_load"]), dropped_fraction=aux["dropped_fraction"])
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch, *, model_cfg):
  """Summed next-token NLL and target count on a held-out batch (perplexity = exp(sum / count))."""
  h, _ = model.hidden_states(params, batch["tokens"], model_cfg, segment_ids=batch["segment_ids"],
                             positions=batch["positions"])
  targets, tmask = losses.shifted_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], 1)
  ce, n = head.cross_entropy(h, model.lm_head(params, model_cfg), targets, tmask)
  return {"nll_sum": ce * n, "count": n}


def make_train_step(model_cfg, train_cfg, optimizer, state_shardings, batch_sharding, rules=None):
  """`train_step` jitted with explicit in/out shardings and the state donated; traced under `use_rules(rules)`
  (given: the table the params were placed with, which the per-device head and EP region read)."""
  step = functools.partial(train_step, model_cfg=model_cfg, train_cfg=train_cfg, optimizer=optimizer,
                           grad_shardings=state_shardings.params)

  def fn(state, batch):
    with use_rules(rules if rules is not None else current_rules()):
      return step(state, batch)
  fn.__name__ = fn.__qualname__ = "train_step"     # the compiled module stays jit_train_step (profiles, dumps)
  # Replicated metrics can be fetched by every process of a multi-process run.
  replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
  return jax.jit(fn, in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, replicated),
                 donate_argnums=0)


def make_eval_step(model_cfg, params_shardings, batch_sharding):
  fn = functools.partial(eval_step, model_cfg=model_cfg)
  return jax.jit(fn, in_shardings=(params_shardings, batch_sharding),
                 out_shardings=NamedSharding(batch_sharding.mesh, PartitionSpec()))
