"""The engine's decode expert paths (dense two-GEMM vs grouped matmul) and the unrolled (split) layer stacks."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.sampling import cached_model as cm
from composer_jax.sampling.engine import EngineConfig, JaxEngine, generation_moe_impl
from rollout.engines.protocol import GenerateRequest, SamplingParams

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                        num_nextn_predict_layers=1)


def test_split_layers_decode_equals_scanned():
  """A decode step over split (unrolled) params and cache equals the scanned stacked one, cache included."""
  params = model.init(jax.random.key(1), dataclasses.replace(CFG, initializer_range=0.2))
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
  """The engine's 'dense' (two GEMMs, the CPU default) and 'model' (here grouped matmul) paths agree."""
  params = model.init(jax.random.key(2), dataclasses.replace(CFG, initializer_range=0.2))
  reqs = [GenerateRequest(tuple(range(i + 1, 2 * i + 4)), SamplingParams(temperature=0.0, max_tokens=12))
          for i in range(4)]
  ragged = dataclasses.replace(CFG, moe_impl="ragged")   # 'model' then means grouped matmuls, as on a GPU
  outs = [JaxEngine(params, ragged, EngineConfig(speculative=speculative, moe_impl=e, min_batch_bucket=4,
                                              min_prompt_bucket=8, min_len_bucket=16)).generate(reqs)
          for e in ("dense", "model")]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(a.output_ids, b.output_ids)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("choice, model_impl, matmul, platform, want", [
  ("auto", "ragged", "bf16", "cpu", "dense"),        # CPU: two plain GEMMs beat XLA:CPU's masked grouped matmul
  ("auto", "blocked", "bf16", "cpu", "dense"),       # ... and, at a few tokens per step, sorting into blocks
  ("auto", "auto", "bf16", "cpu", "dense"),
  ("auto", "ragged", "bf16", "gpu", "ragged"),       # elsewhere the model's own
  ("auto", "ep_ragged", "bf16", "gpu", "ep_ragged"),
  ("auto", "auto", "bf16", "gpu", "ragged"),
  ("auto", "ragged", "mxfp8", "cpu", "ragged"),      # quantised expert matmuls exist only on the ragged path
  ("model", "ragged", "bf16", "cpu", "ragged"),
  ("model", "capacity", "bf16", "gpu", "ragged"),    # dropping depends on the batch: never in generation
  ("dense", "ragged", "bf16", "gpu", "dense"),
  ("capacity", "dense", "bf16", "cpu", "ragged"),
])
def test_generation_moe_impl(choice, model_impl, matmul, platform, want):
  cfg = dataclasses.replace(CFG, moe_impl=model_impl, moe_matmul=matmul)
  assert generation_moe_impl(cfg, choice, platform) == want


def test_bad_engine_config_raises():
  params = model.init(jax.random.key(2), dataclasses.replace(CFG, initializer_range=0.2))
  with pytest.raises(ValueError, match=r"EngineConfig.moe_impl='fast'; valid: \['auto', 'model', 'dense'"):
    JaxEngine(params, CFG, EngineConfig(moe_impl="fast"))
  with pytest.raises(ValueError, match="draft_tokens"):
    JaxEngine(params, CFG, EngineConfig(speculative=True, draft_tokens=0))
