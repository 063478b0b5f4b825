"""The RL step: `rl_step(state, batch, ref_params) -> (state, metrics)`, one optimizer step per batch, and
`make_rl_step`, the step jitted on its mesh (as `train.step` holds `train_step` and `make_train_step`).

Shapes: B rows, L length, V vocab, E experts, K experts per token, Lm MoE layers. The batch is
`composer_jax.rl.batch.make_batch`'s; `state` is `composer_jax.train.step.TrainState` and the optimizer the
pretraining one (`train.optim.make_optimizer`), so sharding, checkpointing and restore are the LM trainer's.

Forward passes per step (router replay on, the default):
  1. reference   π_ref(ref_params) with the replayed routing, no gradient           → k1 KL
  2. unreplayed  π_θ with its own routing, no gradient                               → fills the positions the
     engine did not report, and gives the train-vs-inference gap *without* replay
  3. policy      π_θ with the replayed routing, differentiated                      → loss, gap *with* replay
Pass 2 runs only with replay on, and only when it is needed (a `lax.cond`, so one compiled program): when some
position that a trained token depends on has no recorded routing, or on the steps where its metric is due
(`RLConfig.unreplayed_every`). Engines that report prompt routing too (the JAX engine, SGLang) leave nothing to
fill, so most steps run two forwards and one backward; on the others `logprob_gap_no_replay` is NaN (not measured).
Without replay pass 3 *is* unreplayed.

Routing mismatch: at every MoE layer of pass 3, the trainer's own top-k (from its router scores and bias, given
the replayed upstream) is compared as a set with the replayed experts, on positions the engine reported:
`routing_mismatch_rate` per (layer, token), `routing_mismatch_token_rate` per token (any layer differs). Without
replay, pass 3 runs on the trainer's own routing and the mismatch is measured against the engine's record.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import model
from composer_jax.model.config import ModelConfig
from composer_jax.model.moe import select_experts
from composer_jax.parallel.rules import ShardingRules, current_rules, use_rules
from composer_jax.rl import losses
from composer_jax.rl.config import RLConfig
from composer_jax.train import losses as lm_losses
from composer_jax.train import step as train_step_lib
from composer_jax.train.step import TrainState


def own_routing(params: dict, router_scores_LmxBxLxE: jax.Array, cfg: ModelConfig) -> jax.Array:
  """The top-k each MoE layer would pick from these router scores (with its correction bias), [Lm, B, L, K]."""
  Lm, B, L, E = router_scores_LmxBxLxE.shape
  if Lm == 0:
    return jnp.zeros((0, B, L, cfg.num_experts_per_tok), jnp.int32)
  bias_LmxE = jax.lax.stop_gradient(params["moe_layers"]["moe"]["bias"])
  sel = jax.vmap(lambda s, b: select_experts(s.reshape(B * L, E), b, cfg))(router_scores_LmxBxLxE, bias_LmxE)
  return sel.reshape(Lm, B, L, -1)


def routing_mismatch(own_LmxBxLxK: jax.Array, replayed_LmxBxLxK: jax.Array, recorded_LmxBxL: jax.Array,
                     valid_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(per layer-token, per token) fraction of recorded positions whose top-k *sets* differ."""
  differ = jnp.any(jnp.sort(own_LmxBxLxK, -1) != jnp.sort(replayed_LmxBxLxK, -1), axis=-1)
  m = recorded_LmxBxL & valid_BxL[None]
  per_layer = jnp.sum(differ & m) / jnp.maximum(jnp.sum(m), 1)
  tok_m = jnp.any(m, axis=0)
  per_token = jnp.sum(jnp.any(differ & m, axis=0)) / jnp.maximum(jnp.sum(tok_m), 1)
  return per_layer.astype(jnp.float32), per_token.astype(jnp.float32)


def _hidden(params, batch, cfg: ModelConfig, routing, detach_mtp=False):
  branches = (batch["branch"], batch["branch_end"]) if "branch" in batch else None   # shared tree prefixes
  return model.hidden_states(params, batch["tokens"], cfg, segment_ids=batch["segment_ids"],
                             positions=batch["positions"], routing=routing, mtp_detach_trunk=detach_mtp,
                             branches=branches)


def _tempered(w_DxV: jax.Array, temperature: float) -> jax.Array:
  """The LM head with 1/T folded in: h @ (w / T) = logits / T (w itself at T = 1)."""
  return w_DxV if temperature == 1.0 else w_DxV / jnp.asarray(temperature, w_DxV.dtype)


def _frozen_logprobs(params, batch, cfg: ModelConfig, routing, temperature: float):
  """Token logprobs at `temperature` of frozen `params` (no gradient) and the forward's aux."""
  params = jax.lax.stop_gradient(params)
  h, aux = _hidden(params, batch, cfg, routing)
  return losses.token_logprobs(h, _tempered(model.lm_head(params, cfg), temperature), batch["tokens"],
                               prev_BxL=batch.get("prev")), aux


def sequence_index(batch: dict) -> tuple[jax.Array, int]:
  """([B, L] sequence of each token, S): the batch's `seq` (packed rows, `rl.batch`), or row i for a batch
  without it (one sequence per row)."""
  if "seq" in batch:
    return batch["seq"], batch["reward"].shape[0]
  B, L = batch["tokens"].shape
  return jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, L)), B


def routing_needed(batch: dict) -> jax.Array:
  """[B, L] positions whose routing a trained token depends on: real tokens before their sequence's last
  generated one.

  Causal attention within a sequence: the logprob of the token at p is computed at p − 1 from positions ≤ p − 1
  of the same sequence, so routing after its last generated token (an engine's never-fed final token, trailing
  tool output) changes no loss term. A sequence is contiguous in its row, so "before" is a flat-index compare.
  Rows with shared tree prefixes (`branch`): a prefix serves every branch after it in its packed sequence, so
  there "sequence" is the packed one (row, segment id).
  """
  B, L = batch["tokens"].shape
  seq, S = sequence_index(batch)
  if "branch" in batch:
    seq, S = jnp.arange(B, dtype=jnp.int32)[:, None] * (L + 1) + batch["segment_ids"], B * (L + 1)
  flat = jnp.arange(B * L, dtype=jnp.int32).reshape(B, L)
  last_S = jax.ops.segment_max(jnp.where(batch["gen_mask"] > 0, flat, -1).ravel(), seq.ravel(), num_segments=S)
  return (flat < last_S[seq]) & (batch["segment_ids"] > 0)


def mtp_gen_mask(batch: dict, n_modules: int) -> jax.Array:
  """The generated tokens the MTP modules are scored on: all of them, except in rows with shared tree prefixes,
  where a token is dropped unless it and its `n_modules` row predecessors follow their stream predecessors (the
  modules read the next tokens of the row, which after a branch point are another branch's)."""
  mask = batch["gen_mask"]
  if "prev" not in batch:
    return mask
  L = mask.shape[1]
  linear_BxL = batch["prev"] == jnp.arange(L, dtype=jnp.int32)[None] - 1
  ok_BxL = linear_BxL
  for i in range(1, n_modules + 1):
    ok_BxL = ok_BxL & jnp.pad(linear_BxL, ((0, 0), (i, 0)), constant_values=True)[:, :L]
  return mask * ok_BxL


def replay_routing(params, batch: dict, cfg: ModelConfig, measure_unreplayed, temperature: float = 1.0
                   ) -> tuple[jax.Array, jax.Array]:
  """(routing to replay [Lm, B, L, K], `logprob_gap_no_replay` or NaN) — pass 2 of the module docstring.

  The recorded experts are replayed where present; the rest take the policy's own choice from an unreplayed
  forward, which runs only if a needed position is unrecorded or `measure_unreplayed` (a traced bool) is set.
  Without it, unrecorded positions (none of them needed) take expert 0, a valid index that no loss term sees.
  """
  recorded = batch["routing"]
  missing = jnp.any((recorded < 0) & routing_needed(batch)[None, ..., None])

  def unreplayed(_):
    logp, aux = _frozen_logprobs(params, batch, cfg, None, temperature)
    gap = lm_losses.masked_mean(jnp.abs(logp - batch["inf_logprobs"]), batch["gen_mask"])
    return jnp.where(recorded >= 0, recorded, aux["experts"]), gap

  def recorded_only(_):
    return jnp.where(recorded >= 0, recorded, 0), jnp.full((), jnp.nan, jnp.float32)
  return jax.lax.cond(missing | measure_unreplayed, unreplayed, recorded_only, None)


def rl_loss_fn(params, batch, ref_params, *, model_cfg: ModelConfig, rl_cfg: RLConfig, measure_unreplayed=True):
  """The RL loss of `params` on `batch` and its metrics (see the module docstring for the passes).

  `measure_unreplayed` (bool, may be traced): run pass 2 for its metric even when no routing is missing.
  """
  cfg_no_mtp = dataclasses.replace(model_cfg, num_nextn_predict_layers=0)
  trains_mtp = rl_cfg.mtp_weight > 0 and model_cfg.num_nextn_predict_layers > 0
  detach_mtp = not (trains_mtp and rl_cfg.mtp_trunk_grad)
  tokens, mask = batch["tokens"], batch["gen_mask"]
  valid_BxL = batch["segment_ids"] > 0
  recorded = batch["routing"]                                  # −1: not reported by the engine
  has_moe = recorded.shape[0] > 0
  metrics = {}

  replay = None
  if has_moe and rl_cfg.router_replay:
    replay, metrics["logprob_gap_no_replay"] = replay_routing(params, batch, cfg_no_mtp, measure_unreplayed,
                                                              rl_cfg.temperature)

  h, aux = _hidden(params, batch, model_cfg, replay, detach_mtp=detach_mtp)
  w = model.lm_head(params, model_cfg)
  logp, entropy = losses.token_logprobs(h, _tempered(w, rl_cfg.temperature), tokens, with_entropy=True,
                                        prev_BxL=batch.get("prev"))
  ref_logp, _ = _frozen_logprobs(ref_params, batch, cfg_no_mtp, replay if rl_cfg.ref_router_replay else None,
                                 rl_cfg.temperature)

  adv_S = losses.group_advantages(batch["reward"], batch["group"], batch["first"], batch["valid"],
                                  scale_by_std=rl_cfg.loss.adv_std, eps=rl_cfg.loss.adv_eps)
  seq, S = sequence_index(batch)
  adv, weight = adv_S[seq], None
  if "token_adv" in batch:   # tree groups: per-token credit and leaf-count weights from `rl.batch`
    if rl_cfg.loss.adv_std:
      raise ValueError("rl.loss.adv_std is not available for tree groups (their advantages are per node)")
    adv, weight = batch["token_adv"], batch["loss_weight"]
  loss, loss_metrics = losses.policy_loss(logp, batch["inf_logprobs"], ref_logp, adv, mask,
                                          batch["is_cap"][seq], rl_cfg.loss, seq_BxL=seq, num_seqs=S,
                                          weight_BxL=weight)
  metrics.update(loss_metrics)
  metrics["pg_loss"] = loss
  if model_cfg.num_nextn_predict_layers:
    mtp_h = aux["mtp_hidden"] if trains_mtp else jax.lax.stop_gradient(aux["mtp_hidden"])
    mtp_loss, mtp_metrics = losses.mtp_self_distill(h, mtp_h, w, model.lm_head(params, model_cfg, detach=detach_mtp),
                                                    tokens, batch["segment_ids"],
                                                    mtp_gen_mask(batch, model_cfg.num_nextn_predict_layers),
                                                    rl_cfg.temperature)
    metrics.update(mtp_metrics)
    if trains_mtp:
      loss = loss + rl_cfg.mtp_weight * mtp_loss
    if rl_cfg.mtp_start_metrics:
      metrics.update(start_drafter_metrics(params, ref_params, batch, model_cfg, replay, rl_cfg.temperature))

  if has_moe:
    own = own_routing(params, jax.lax.stop_gradient(aux["router_scores"]), model_cfg)
    per_layer, per_token = routing_mismatch(own, recorded, jnp.all(recorded >= 0, -1), valid_BxL)
    metrics.update(routing_mismatch_rate=per_layer, routing_mismatch_token_rate=per_token)
  key = "logprob_gap_replay" if replay is not None else "logprob_gap_no_replay"
  metrics[key] = loss_metrics["logprob_gap"]

  first = batch["first"] * batch["valid"]
  n_traj = jnp.maximum(jnp.sum(first), 1.0)
  metrics.update(loss=loss, entropy=lm_losses.masked_mean(jax.lax.stop_gradient(entropy), mask),
                 reward=jnp.sum(batch["reward"] * first) / n_traj, pass_rate=jnp.sum(batch["passed"] * first) / n_traj,
                 length=jnp.sum(batch["traj_gen_tokens"] * first) / n_traj, trajectories=jnp.sum(first),
                 advantage_abs_mean=jnp.sum(jnp.abs(adv_S) * first) / n_traj,
                 staleness_mean=jnp.sum(batch["staleness"] * first) / n_traj)
  return loss, (metrics, aux)


def start_drafter_metrics(params, ref_params, batch, cfg: ModelConfig, routing, temperature: float) -> dict:
  """`mtp_start_*`: the agreement of the start's MTP modules (`ref_params`) with the current policy's trunk, i.e.
  what a drafter frozen at the start of RL would get now (no gradient)."""
  mixed = jax.lax.stop_gradient({**params, "mtp": ref_params["mtp"]})
  h, aux = _hidden(mixed, batch, cfg, routing)
  w = model.lm_head(mixed, cfg)
  _, m = losses.mtp_self_distill(h, aux["mtp_hidden"], w, w, batch["tokens"], batch["segment_ids"],
                                 mtp_gen_mask(batch, cfg.num_nextn_predict_layers), temperature)
  return {"mtp_start_agreement": m["mtp_agreement"], "mtp_start_acceptance": m["mtp_acceptance"]}


def rl_step(state: TrainState, batch: dict, ref_params: dict, *, model_cfg: ModelConfig, rl_cfg: RLConfig,
            optimizer: optax.GradientTransformation) -> tuple[TrainState, dict]:
  """One optimizer step on one batch of whole groups; `ref_params` is frozen (no gradient, not updated)."""
  grad_fn = jax.value_and_grad(rl_loss_fn, has_aux=True)
  every = rl_cfg.unreplayed_every
  measure = (state.step % every == 0) if every else False
  (_, (metrics, aux)), grads = grad_fn(state.params, batch, ref_params, model_cfg=model_cfg, rl_cfg=rl_cfg,
                                       measure_unreplayed=measure)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  loads = {"moe_layers": aux["expert_load"]}
  if rl_cfg.mtp_weight > 0 and model_cfg.num_nextn_predict_layers:   # the MTP blocks' own routing, when trained
    loads["mtp"] = aux["mtp_expert_load"]
  params = train_step_lib.update_router_bias(params, loads, rl_cfg.bias_update_rate)
  metrics.update(train_step_lib.update_metrics(grads, updates, params, aux["expert_load"]))
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_rl_step(model_cfg: ModelConfig, rl_cfg: RLConfig, optimizer, state_shardings, batch_sharding,
                 ref_shardings, rules: ShardingRules | None = None):
  """`rl_step` jitted with explicit shardings (as `train.step.make_train_step`), the state donated, traced under
  `use_rules(rules)` (given: the table the params were placed with, which the per-device head, the EP region and
  the activation constraints read; None: the table in force where it is traced).

  `batch_sharding` may be a pytree of shardings matching the batch (e.g. `routing` sharded on its B axis, which
  is axis 1) or one sharding for every leaf. The metrics come back replicated, so every process of a
  multi-process run can read them. Call it inside `jax.set_mesh(mesh)` when the model has shard_map regions
  (`rl.placement.RLStep` does).
  """
  step = functools.partial(rl_step, model_cfg=model_cfg, rl_cfg=rl_cfg, optimizer=optimizer)

  def fn(state, batch, ref_params):
    with use_rules(rules if rules is not None else current_rules()):
      return step(state, batch, ref_params)
  fn.__name__ = fn.__qualname__ = "rl_step"       # the compiled module stays jit_rl_step (the scale plan reads it)
  mesh = jax.tree.leaves(state_shardings)[0].mesh
  return jax.jit(fn, in_shardings=(state_shardings, batch_sharding, ref_shardings),
                 out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)
