"""AdamW with warmup + cosine, clipping, and the parameter masks a MoE needs.

Weight decay skips vectors (norm scales, biases). The router's correction bias (`moe/bias`, HF's
`e_score_correction_bias`) is not trained by the optimizer at all: DeepSeek-V3 updates it outside the gradient from
the expert load (see `step.update_router_bias`).
"""
from __future__ import annotations

import jax
import optax

from composer_jax.train.config import OptimConfig

ROUTER_BIAS = "moe/bias"


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def is_router_bias(path) -> bool:
  return _path_str(path).endswith(ROUTER_BIAS)


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.warmup_steps + cfg.decay_steps, end_value=cfg.learning_rate * cfg.final_lr_fraction)


def make_optimizer(cfg: OptimConfig, params, frozen: tuple[str, ...] = ()) -> optax.GradientTransformation:
  """AdamW over all trainable params; router correction biases are frozen to the optimizer, and so are the
  top-level param subtrees named in `frozen` (`freeze_subtrees`).

  Stacked layers carry a leading `layers` axis, so "a vector" means the last axis alone is meaningful: we decay
  only leaves whose name marks them as a matrix (no `norm`/`bias` in their path) and of rank ≥ 2.
  """
  def decay_mask(p):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim >= 2 and "norm" not in _path_str(path) and "bias" not in _path_str(path), p)

  labels = jax.tree_util.tree_map_with_path(lambda path, _: "frozen" if is_router_bias(path) else "train", params)
  adamw = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
  optimizer = optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)
  return freeze_subtrees(optimizer, params, frozen) if frozen else optimizer


def freeze_subtrees(optimizer: optax.GradientTransformation, params, names: tuple[str, ...]
                    ) -> optax.GradientTransformation:
  """`optimizer` with the top-level param subtrees `names` frozen (zero updates, so no weight decay either): a
  module that gets no gradient (the RL step's MTP heads when it does not train them, `RLConfig.frozen_subtrees`)
  would otherwise still shrink every step under AdamW's decoupled weight decay."""
  labels = {k: jax.tree.map(lambda _, k=k: "frozen" if k in names else "train", v) for k, v in params.items()}
  return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)
