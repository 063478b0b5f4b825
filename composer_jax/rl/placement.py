"""The RL step on a mesh: its state, the frozen reference params and each batch placed by the logical rules.

`build_step` is the one builder of the RL step: the trainer runs what it returns, and `benchmarks/scale_plan.py`
compiles what it returns on the plan's meshes, so the program the plan measures is the program the run executes.
It checks the mesh against the model and the step's shape first (`check_mesh`): a mesh axis that does not divide
the experts, the heads, a step's rows or its length is one error naming the axis, the sizes and the field to change.

Placement: params, the reference and the optimizer state as `model.shardings` + `train.step.state_shardings` say
(the LM trainer's layout, ZeRO-1 included); a batch's [B, L] fields with rows over the `batch` mesh axes and length
over the `seq` ones (`step.batch_shardings`). In a multi-process run every process builds the same global batch
from the same groups and `place` keeps only the slices its own devices hold, so no process ships rows to another.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from composer_jax import model
from composer_jax.model.config import ModelConfig
from composer_jax.parallel import layout
from composer_jax.parallel.rules import ShardingRules
from composer_jax.rl import step as rl_step
from composer_jax.rl.config import RLConfig
from composer_jax.train import checkpoint as ckpt_lib
from composer_jax.train import optim
from composer_jax.train import step as step_lib


def _axes_over(logical: str, mesh: Mesh, rules: ShardingRules) -> tuple[str, ...]:
  return tuple(a for a in rules.mesh_axes(logical) if a in mesh.axis_names and dict(mesh.shape)[a] > 1)


def _check(size: int, what: str, logical: str, mesh: Mesh, rules: ShardingRules, fix: str, factor: int = 1) -> None:
  axes = _axes_over(logical, mesh, rules)
  n = math.prod(dict(mesh.shape)[a] for a in axes) * factor
  if size % n:
    sizes = " x ".join(f"{a}={dict(mesh.shape)[a]}" for a in axes) + (f" x {factor}" if factor > 1 else "")
    raise ValueError(f"mesh axes {sizes} (= {n}) shard {what} but do not divide it ({size}): {fix}")


def step_rows(cfg) -> tuple[int, ...]:
  """The row counts a step's batch of `cfg` (a `RunConfig`) can have: packed, and unpacked for a group that packs
  alone (`rl.batch`)."""
  return tuple(sorted({cfg.rl.pack_rows or cfg.batch_rows, cfg.batch_rows}))


def check_run_mesh(cfg) -> None:
  """`check_mesh` for a `RunConfig` on the axis sizes of its `mesh` (an axis at -1 is known only on the devices)."""
  sizes = cfg.mesh.axis_sizes()
  if -1 not in sizes.values():
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
    check_mesh(cfg.model, mesh, cfg.mesh.rules(), step_rows(cfg), cfg.harness.context_budget)


def check_mesh(model_cfg: ModelConfig, mesh: Mesh, rules: ShardingRules, rows: Sequence[int], length: int) -> None:
  """Raises one `ValueError` naming the mesh axis and the sizes when the mesh does not divide the model's experts
  or heads, a step's row count (each of `rows`: packed, and unpacked for a group that packs alone) or its
  `length`; then checks every param dimension (`layout.check_params_divisible`)."""
  _check(model_cfg.n_routed_experts, "the model's experts (model.n_routed_experts)", "experts", mesh, rules,
         "change mesh.expert")
  _check(model_cfg.num_attention_heads, "the model's attention heads (model.num_attention_heads)", "heads", mesh,
         rules, "change mesh.tensor")
  for r in rows:
    _check(r, "a step's rows (rl.pack_rows, or rl.rows_per_step / rl.groups_per_step x rollout.samples_per_prompt)",
           "batch", mesh, rules, "change them or the mesh axes")
  # Ring and all-gather attention cut a sequence into 2 x context zig-zag chunks.
  zigzag = 2 if model_cfg.attention_impl in ("ring", "allgather") else 1
  _check(length, "a step's length (harness.context_budget)", "seq", mesh, rules, "change it or mesh.context",
         factor=zigzag)
  specs = jax.tree_util.tree_flatten_with_path(model.param_specs(model_cfg),
                                               is_leaf=lambda x: isinstance(x, model.ArrayInfo))[0]
  layout.check_params_divisible(((jax.tree_util.keystr(k), v) for k, v in specs), mesh, rules)


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
    init = jax.jit(lambda p: step_lib.init_state(p, self.optimizer), out_shardings=self.state)
    return init(place_tree(params, self.params))

  def abstract_state(self) -> step_lib.TrainState:
    """The state's shapes with their shardings (restoring a checkpoint onto this mesh)."""
    abstract = jax.eval_shape(lambda: step_lib.init_state(model.abstract_params(self.model_cfg), self.optimizer))
    return ckpt_lib.abstract_like(abstract, self.state)


def build_step(model_cfg: ModelConfig, rl_cfg: RLConfig, mesh: Mesh,
               rules: ShardingRules, *, rows: Sequence[int], length: int, trees: bool = False) -> RLStep:
  """The RL step of `model_cfg` on `mesh` under `rules`, for batches of any of `rows` x `length` (checked first).

  The optimizer is `rl_cfg.optim`'s with the MTP heads frozen unless `rl_cfg.mtp_weight > 0` (AdamW's decay would
  shrink heads that get no gradient); `trees`: batches carry tree groups' `token_adv` and `loss_weight` (and, with
  `rl_cfg.share_prefix`, their shared prefixes' `branch`, `branch_end` and `prev`).
  """
  check_mesh(model_cfg, mesh, rules, rows, length)
  params_sh = model.shardings(model_cfg, mesh, rules)
  abstract = model.abstract_params(model_cfg)
  optimizer = rl_step.rl_optimizer(optim.make_optimizer(rl_cfg.optim, abstract), abstract, rl_cfg)
  state_sh = step_lib.state_shardings(optimizer, abstract, params_sh, rules.mesh_axes("optimizer_state"))
  batch_sh = rl_step.batch_shardings(mesh, rules, trees=trees, share_prefix=trees and rl_cfg.share_prefix)
  fn = rl_step.make_rl_step(model_cfg, rl_cfg, optimizer, state_sh, batch_sh, params_sh, rules)
  return RLStep(model_cfg, mesh, rules, optimizer, params_sh, state_sh, batch_sh, fn)


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
