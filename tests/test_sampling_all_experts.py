"""The decode-time all-experts MoE and the unrolled (split) layer stacks against the model's own paths."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.model import moe
from composer_jax.sampling import cached_model as cm
from composer_jax.sampling.all_experts import moe_all_experts, with_all_experts
from composer_jax.sampling.engine import EngineConfig, JaxEngine
from composer_jax.sampling.random_params import random_params
from rollout.engines.protocol import GenerateRequest, SamplingParams

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                        num_nextn_predict_layers=1)


@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_all_experts_equals_moe_block(impl):
  params = with_all_experts(random_params(CFG, seed=3, std=0.2))
  x = jax.random.normal(jax.random.key(0), (2, 3, CFG.hidden_size))
  for layer in (jax.tree.map(lambda a: a[1], params["moe_layers"]["moe"]),
                jax.tree.map(lambda a: a[0], params["mtp"]["block"]["moe"])):
    got, experts = jax.jit(moe_all_experts, static_argnames="cfg")(layer, x, CFG)
    want, aux = moe.moe_block(layer, x, jnp.ones((2, 3), bool), dataclasses.replace(CFG, moe_impl=impl))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(experts, aux["experts"])


def test_split_layers_decode_equals_scanned():
  """A decode step over split (unrolled) params and cache equals the scanned stacked one, cache included."""
  params = random_params(CFG, seed=1, std=0.2)
  cache = cm.init_cache(params, CFG, 2, 12)
  pad = jnp.array([0, 2], jnp.int32)
  fwd = jax.jit(cm.forward_cached, static_argnames=("cfg", "fresh"))
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 6)), jnp.int32)
  _, _, _, cache = fwd(params, prompt, cache, jnp.zeros(2, jnp.int32), pad, CFG, fresh=True)
  new = jnp.array([[5, 9], [7, 1]], jnp.int32)
  start = jnp.array([6, 6], jnp.int32)
  want = fwd(params, new, cache, start, pad, CFG)
  got = fwd(cm.split_layers(params), new, cm.split_layers(cache), start, pad, CFG)
  for a, b in zip(got[:3], want[:3]):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for name in cm.STACKS:
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *got[3][name])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), stacked, want[3][name])


@pytest.mark.parametrize("speculative", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["plain", "speculative"])
def test_engine_decode_expert_paths_agree(speculative):
  """The engine's 'all' (CPU default) and 'model' (grouped matmul) decode paths: same tokens, routing, logprobs."""
  params = random_params(CFG, seed=2, std=0.2)
  reqs = [GenerateRequest(tuple(range(i + 1, 2 * i + 4)), SamplingParams(temperature=0.0, max_tokens=12))
          for i in range(4)]
  outs = [JaxEngine(params, CFG, EngineConfig(speculative=speculative, decode_experts=e, min_batch_bucket=4,
                                              min_prompt_bucket=8, min_len_bucket=16)).generate(reqs)
          for e in ("all", "model")]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(a.output_ids, b.output_ids)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_bad_engine_config_raises():
  params = random_params(CFG, seed=2, std=0.2)
  with pytest.raises(ValueError, match="decode_experts"):
    JaxEngine(params, CFG, EngineConfig(decode_experts="fast"))
  with pytest.raises(ValueError, match="draft_tokens"):
    JaxEngine(params, CFG, EngineConfig(speculative=True, draft_tokens=0))
