"""Parameter counts from the abstract description (nothing allocated)."""
import dataclasses
import math

from composer_jax.model import ModelConfig, count_params

KIMI_K2 = ModelConfig(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                      num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
                      num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                      routed_scaling_factor=2.827, param_dtype="bfloat16")


def test_kimi_k2_published_sizes():
  total, active = count_params(KIMI_K2)
  # Published: ~1.04T total, 32B activated (no MTP). Ours: 1.026T, 31.7B.
  assert math.isclose(total, 1.04e12, rel_tol=0.02), total
  assert math.isclose(active, 32e9, rel_tol=0.02), active


def test_deepseek_v3_published_sizes():
  v3 = dataclasses.replace(KIMI_K2, vocab_size=129280, num_attention_heads=128, n_routed_experts=256,
                           first_k_dense_replace=3, n_group=8, topk_group=4, num_nextn_predict_layers=1)
  total, active = count_params(v3)
  # Published: 671B main-model parameters (+14B MTP, excluded), 37B activated.
  assert math.isclose(total, 671e9, rel_tol=0.002), total
  assert math.isclose(active, 37e9, rel_tol=0.02), active


def test_tiny_count_by_hand():
  cfg = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, moe_intermediate_size=2, num_hidden_layers=2,
                    first_k_dense_replace=1, num_attention_heads=1, q_lora_rank=None, kv_lora_rank=2,
                    qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2, n_routed_experts=4, num_experts_per_tok=1,
                    n_shared_experts=1, num_nextn_predict_layers=1)
  D, V = 4, 10
  attn = D * 4 + D * 2 + D * 2 + 2 + 2 * 2 + 2 * 2 + 2 * D + 2 * D  # q, kv_a, k_rope, kv_a_norm, k_b, v_b, o, 2 norms
  dense = attn + 3 * D * 6
  routed = 4 * 3 * D * 2
  moe = attn + D * 4 + 4 + routed + 3 * D * 2
  total = V * D + dense + moe + D + D * V
  # MTP excluded from both; active drops 3 of 4 experts and the input embedding table.
  assert count_params(cfg) == (total, total - routed + routed // 4 - V * D)


def test_kimi_k2_config_variant_builds_abstractly_with_published_sizes():
  """`experiments/configs/model.py:kimi_k2` is the real shape: built with eval_shape only, ~1.04T / ~32B."""
  import jax

  from composer_jax import configs
  from composer_jax.model import abstract_params
  from experiments.configs import model as model_configs
  cfg = configs.from_dict(ModelConfig, model_configs.get_config("kimi_k2").to_dict())
  shapes = abstract_params(cfg)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))   # nothing allocated
  total, active = count_params(cfg)
  assert math.isclose(total, 1.04e12, rel_tol=0.02) and math.isclose(active, 32e9, rel_tol=0.02), (total, active)
  assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0
