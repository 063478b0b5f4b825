"""The RL step's whole set-up, built once: its optimizer, shardings and jitted function, the state it starts from,
and the batch shape.

`start_rl_step(cfg, mesh, rules, ref_params)` builds the run's step from its config on the run's mesh in call order
(checks, optimizer, shardings, the state restored from the run's checkpoints or fresh from the warm start, the
jitted step) and hands the trainer all of it (`RLStart`). `build_rl_step(cfg, mesh, rules)` builds the same step
(`build_step` for explicit parts), which `benchmarks/scale_plan.py` compiles on the plan's meshes, so the program
the plan measures is the program the run executes. It checks the mesh against the
model and the step's shape first (`parallel.layout.check_mesh`): a mesh axis that does not divide the experts, the
heads, a step's rows or its length is one error naming the axis, the sizes and the field to change.
`batch_config(cfg)` is the batch shape the sources pack and the trainer places.

Placement: params, the reference and the optimizer state as `model.shardings` + `train.step.state_shardings` say
(the LM trainer's layout, ZeRO-1 included); a batch's [B, L] fields with rows over the `batch` mesh axes and length
over the `seq` ones (`batch_shardings`). In a multi-process run every process builds the same global batch
from the same groups and `place` keeps only the slices its own devices hold, so no process ships rows to another.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import model
from composer_jax.model.config import ModelConfig
from composer_jax.parallel import distributed, layout
from composer_jax.parallel.rules import ShardingRules
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import step as rl_step
from composer_jax.rl.config import RLConfig
from composer_jax.train import checkpoint as ckpt_lib
from composer_jax.train import optim
from composer_jax.train import step as step_lib


@dataclasses.dataclass(frozen=True)
class RLStep:
  """The jitted RL step on `mesh` and where its arguments live; call it like the step: `(state, batch, ref)`."""
  model_cfg: ModelConfig
  mesh: Mesh
  rules: ShardingRules
  optimizer: optax.GradientTransformation
  params: dict            # shardings of the policy's params, and of the frozen reference alike
  state: step_lib.TrainState   # shardings of the train state
  batch: dict             # shardings of the batch fields
  fn: Callable            # `rl.step.make_rl_step`'s jitted function

  def __call__(self, state, batch, ref_params):
    # The expert- and context-parallel regions read the mesh from context at trace time.
    with jax.set_mesh(self.mesh):
      return self.fn(state, batch, ref_params)

  def lower(self, state, batch, ref_params):
    with jax.set_mesh(self.mesh):
      return self.fn.lower(state, batch, ref_params)

  def init_state(self, params) -> step_lib.TrainState:
    """A fresh train state from `params` (placed first), on the state's shardings."""
    return step_lib.fresh_state(place_tree(params, self.params), self.optimizer, self.state)

  def abstract_state(self) -> step_lib.TrainState:
    """The state's shapes with their shardings (restoring a checkpoint onto this mesh)."""
    return step_lib.abstract_state(model.abstract_params(self.model_cfg), self.optimizer, self.state)


def build_step(model_cfg: ModelConfig, rl_cfg: RLConfig, mesh: Mesh,
               rules: ShardingRules, *, rows: Sequence[int], length: int, trees: bool = False) -> RLStep:
  """The RL step of `model_cfg` on `mesh` under `rules`, for batches of any of `rows` x `length` (checked first).

  The optimizer is `rl_cfg.optim`'s with `rl_cfg.frozen_subtrees` frozen (the MTP heads unless the step trains
  them); `trees`: batches carry tree groups' `token_adv` and `loss_weight` (and, with
  `rl_cfg.share_prefix`, their shared prefixes' `branch`, `branch_end` and `prev`).
  """
  p = _placed(model_cfg, rl_cfg, mesh, rules, rows, length, trees)
  fn = rl_step.make_rl_step(model_cfg, rl_cfg, p.optimizer, p.state, p.batch, p.params, rules)
  return RLStep(model_cfg, mesh, rules, p.optimizer, p.params, p.state, p.batch, fn)


class _Placed(NamedTuple):
  batch: dict                  # shardings of the batch fields
  params: dict                 # shardings of the params
  abstract: dict               # the params' shapes
  optimizer: optax.GradientTransformation
  state: step_lib.TrainState   # shardings of the train state


def _placed(model_cfg: ModelConfig, rl_cfg: RLConfig, mesh: Mesh, rules: ShardingRules, rows: Sequence[int],
            length: int, trees: bool) -> _Placed:
  """The step's batch shardings, its checks, the params' shardings and abstract params, the optimizer and the
  state's shardings, in that order."""
  batch_sh = batch_shardings(mesh, rules, trees=trees, share_prefix=trees and rl_cfg.share_prefix)
  layout.check_mesh(model_cfg, mesh, rules, rows, length)
  params_sh = model.shardings(model_cfg, mesh, rules)
  abstract = model.abstract_params(model_cfg)
  optimizer = optim.make_optimizer(rl_cfg.optim, abstract, frozen=rl_cfg.frozen_subtrees)
  state_sh = step_lib.state_shardings(optimizer, abstract, params_sh, rules.mesh_axes("optimizer_state"))
  return _Placed(batch_sh, params_sh, abstract, optimizer, state_sh)


def batch_shardings(mesh, rules: ShardingRules | None = None, trees: bool = False, share_prefix: bool = False) -> dict:
  """NamedShardings for `make_batch`'s fields, laid out as the LM trainer's batch (`parallel.layout.batch_spec`):
  rows over the `batch` mesh axes, length over the `seq` ones; routing [Lm, B, L, K] likewise on its B and L axes.
  The per-sequence [S] fields are replicated: they are small, and a packed row's tokens index any of them.
  `trees`: the batches hold tree groups (their `token_adv` and `loss_weight` fields); `share_prefix`: and are
  built with `BatchConfig.share_prefix` (their `branch`, `branch_end` and `prev` fields)."""
  rows_spec, seq_spec = layout.batch_spec(mesh, rules if rules is not None else ShardingRules())
  per_token = rl_batch.per_token_fields(trees, share_prefix)
  out = {k: NamedSharding(mesh, P(rows_spec, seq_spec)) for k in per_token}
  out |= {k: NamedSharding(mesh, P()) for k in rl_batch.PER_SEQUENCE}
  out["routing"] = NamedSharding(mesh, P(None, rows_spec, seq_spec))
  return out


def build_rl_step(cfg, mesh: Mesh, rules: ShardingRules) -> RLStep:
  """The run's RL step (`build_step` for `cfg`'s model, RL config and step shape) on `mesh` under `rules` (the
  run's: `setup.Run.mesh`, `Run.rules`)."""
  return build_step(cfg.model, cfg.rl, mesh, rules, rows=cfg.step_rows, length=cfg.harness.context_budget,
                    trees=cfg.rollout.tree is not None)


class RLStart(NamedTuple):
  """What the RL trainer is handed: its step, the state it starts from, the frozen reference, its checkpoints."""
  step: RLStep
  state: step_lib.TrainState
  ref_params: dict          # the warm start, placed on the params' shardings
  ckpts: ckpt_lib.Checkpointer


def start_rl_step(cfg, mesh: Mesh, rules: ShardingRules, ref_params) -> RLStart:
  """The run's RL step (as `build_rl_step` builds it) and where it starts, in call order: the checks, the optimizer
  and the shardings; the state, restored from the newest checkpoint in `cfg.workdir` (`workdir/checkpoints`), else
  the step-0 state of the warm start `ref_params` (as the LM loop starts, `train.step.start_state`); the jitted
  step."""
  trees = cfg.rollout.tree is not None
  p = _placed(cfg.model, cfg.rl, mesh, rules, cfg.step_rows, cfg.harness.context_budget, trees)
  ref = place_tree(ref_params, p.params)
  # Processes get here at different times, and a gloo (CPU) collective, as orbax's first sync, waits for a late
  # peer only 30 s: meet in the coordination service first.
  distributed.barrier("rl_trainer_start")
  ckpts = ckpt_lib.Checkpointer(cfg.workdir, keep=2, async_save=False)
  state = step_lib.start_state(ckpts, p.optimizer, p.state, p.abstract, lambda: ref)
  fn = rl_step.make_rl_step(cfg.model, cfg.rl, p.optimizer, p.state, p.batch, p.params, rules)
  return RLStart(RLStep(cfg.model, mesh, rules, p.optimizer, p.params, p.state, p.batch, fn), state, ref, ckpts)


def batch_config(cfg) -> rl_batch.BatchConfig:
  """A step's batch shape: `batch_rows` segments of up to context_budget tokens, packed into `rl.pack_rows`."""
  return rl_batch.BatchConfig(rows=cfg.batch_rows, length=cfg.harness.context_budget, pack_rows=cfg.rl.pack_rows,
                              n_moe_layers=cfg.model.num_hidden_layers - cfg.model.first_k_dense_replace,
                              top_k=cfg.model.num_experts_per_tok, share_prefix=cfg.rl.share_prefix)


def place(x, sharding: NamedSharding) -> jax.Array:
  """`x` on `sharding`: as is if already there; a device array by `device_put` (device to device, no host copy);
  a host array, or a process's own copy going to devices of several processes (the same values in every process),
  by each process taking only its devices' slices."""
  if isinstance(x, jax.Array):
    if x.sharding.is_equivalent_to(sharding, x.ndim):
      return x
    if (x.is_fully_addressable and sharding.is_fully_addressable) or not x.is_fully_replicated:
      return jax.device_put(x, sharding)
    x = x.addressable_data(0)   # every process holds all of it: each takes its slices from its own copy
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def place_tree(tree, shardings):
  return jax.tree.map(place, tree, shardings)
