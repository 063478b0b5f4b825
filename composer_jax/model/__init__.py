"""The DeepSeek-V3 / Kimi-K2 family MoE transformer in pure JAX (params are plain pytrees)."""
from composer_jax.model.config import ModelConfig, RopeScaling
from composer_jax.model.head import lm_head
from composer_jax.model.params import ArrayInfo, abstract_params, count_params, init, param_specs, shardings
from composer_jax.model.transformer import forward, hidden_states

__all__ = ["ArrayInfo", "ModelConfig", "RopeScaling", "abstract_params", "count_params", "forward", "hidden_states",
           "init", "lm_head", "param_specs", "shardings"]
