"""Random params drawn with NumPy on the host: no jitted initialiser to compile (tests, benchmarks, notebooks).

The layout and dtypes come from `model.abstract_params`; weights are N(0, std^2), norms one, router biases zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax import model
from composer_jax.model.config import ModelConfig


def random_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict:
  """Params with `model.init`'s structure, shapes and dtypes."""
  rng = np.random.default_rng(seed)
  abstract = model.abstract_params(cfg)

  def leaf(path, a):
    name = jax.tree_util.keystr(path)
    if name.endswith("norm']"):
      return jnp.ones(a.shape, a.dtype)
    if name.endswith("['bias']"):
      return jnp.zeros(a.shape, a.dtype)
    return jnp.asarray(rng.normal(0.0, std, a.shape).astype(np.float32), a.dtype)

  return jax.tree_util.tree_map_with_path(leaf, abstract)
