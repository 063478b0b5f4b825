"""Numerical parity with transformers' own DeepseekV3ForCausalLM (CPU torch, float32) on tiny random configs."""
import functools

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the test-only reference implementation")
transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference implementation")

from composer_jax.interop import hf  # noqa: E402
from composer_jax.model import forward  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, q_lora_rank=None,
            num_mtp_layers=0, tie_word_embeddings=False, initializer_range=0.1, rope_theta=10000.0,
            max_position_embeddings=64)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}

CASES = {
    # Full-rank query, plain RoPE, one dense layer then one MoE layer.
    "q_full_plain_rope": dict(),
    # Low-rank query, group-limited routing (4 groups, best 2), 2 shared experts, scaling 2.5, YaRN.
    "q_lora_groups_yarn": dict(q_lora_rank=16, n_group=4, topk_group=2, n_shared_experts=2,
                               routed_scaling_factor=2.5, num_hidden_layers=3, rope_parameters=YARN),
    # No dense layer, no top-k normalisation, YaRN with mscale_all_dim=0 (HF's get_mscale(factor) path),
    # non-interleaved rope.
    "all_moe_unnormalised": dict(first_k_dense_replace=0, norm_topk_prob=False, rope_interleave=False,
                                 rope_parameters={**YARN, "mscale": 0.8, "mscale_all_dim": 0.0}),
}


def _hf_config(**kw):
  kw = {**BASE, **kw}
  if "rope_parameters" in kw:
    kw["rope_parameters"] = {**kw["rope_parameters"], "rope_theta": kw["rope_theta"]}
  return transformers.DeepseekV3Config(**kw)


def _randomise(model, seed):
  """Non-trivial norms, random non-zero selection bias, and well-separated router scores."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
      if name.endswith("mlp.gate.weight"):
        p.copy_(0.8 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.2 * torch.randn(b.shape, generator=g))


@functools.cache
def _hf_checkpoint(case, tmp_root):
  torch.manual_seed(0)
  model = transformers.DeepseekV3ForCausalLM(_hf_config(**CASES[case])).eval()
  _randomise(model, 1)
  path = f"{tmp_root}/{case}"
  model.save_pretrained(path)
  return model, path


def _hf_run(model, tokens):
  """HF logits and each MoE layer's selected experts (read by hooking its router)."""
  picked = []
  hooks = [m.register_forward_hook(lambda mod, inp, out: picked.append(out[2]))
           for m in model.modules() if isinstance(m, transformers.models.deepseek_v3.modeling_deepseek_v3.
                                                  DeepseekV3TopkRouter)]
  with torch.no_grad():
    logits = model(torch.tensor(np.array(tokens))).logits.numpy()
  for h in hooks:
    h.remove()
  return logits, np.stack([np.sort(p.numpy(), -1) for p in picked])


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
  return str(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_experts_match_transformers(case, tmp_root):
  model, path = _hf_checkpoint(case, tmp_root)
  cfg, params = hf.load(path, moe_impl="ragged")
  tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, cfg.vocab_size)
  logits, aux = jax.jit(functools.partial(forward, cfg=cfg))(params, tokens)
  ref_logits, ref_experts = _hf_run(model, tokens)
  # float32 end to end; differences are summation order only (~1e-6 observed).
  np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=0, atol=1e-4)
  n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
  ours = np.sort(np.asarray(aux["experts"]).reshape(n_moe, -1, cfg.num_experts_per_tok), -1)
  np.testing.assert_array_equal(ours, ref_experts)


def test_packed_documents_match_transformers_per_document(tmp_root):
  model, path = _hf_checkpoint("q_lora_groups_yarn", tmp_root)
  cfg, params = hf.load(path, moe_impl="dense")
  lens = (9, 6, 5)
  docs = [jax.random.randint(jax.random.key(10 + i), (1, n), 0, cfg.vocab_size) for i, n in enumerate(lens)]
  packed = np.concatenate([np.asarray(d) for d in docs], axis=1)
  seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)])[None]
  pos = np.concatenate([np.arange(n) for n in lens])[None]
  logits, aux = jax.jit(functools.partial(forward, cfg=cfg))(params, packed, segment_ids=seg, positions=pos)
  start = 0
  for d, n in zip(docs, lens):
    ref_logits, ref_experts = _hf_run(model, d)
    np.testing.assert_allclose(np.asarray(logits[:, start:start + n]), ref_logits, rtol=0, atol=1e-4)
    ours = np.sort(np.asarray(aux["experts"][:, 0, start:start + n]), -1)
    np.testing.assert_array_equal(ours, ref_experts)
    start += n


def test_save_pretrained_with_default_mtp_setting_loads(tmp_path):
  """transformers' default num_nextn_predict_layers=1 writes no MTP weights: the module is initialised fresh with a
  warning (the trunk still matches transformers), dropped on request, and refused on request or when partial."""
  kw = {k: v for k, v in BASE.items() if k != "num_mtp_layers"}
  torch.manual_seed(0)
  model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw)).eval()
  assert model.config.num_nextn_predict_layers == 1
  _randomise(model, 1)
  path = str(tmp_path / "ckpt")
  model.save_pretrained(path)
  with pytest.warns(UserWarning, match=r"no tensors for MTP module\(s\) 0 \(model\.layers\.2\.\*\).*fresh"):
    cfg, params = hf.load(path)
  assert cfg.num_nextn_predict_layers == 1 and params["mtp"]["eh_proj"].shape == (1, 64, 32)
  assert float(np.abs(np.asarray(params["mtp"]["eh_proj"])).max()) > 0   # initialised, not zeros
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, cfg.vocab_size)
  logits, _ = jax.jit(functools.partial(forward, cfg=cfg))(params, tokens)
  np.testing.assert_allclose(np.asarray(logits), _hf_run(model, tokens)[0], rtol=0, atol=1e-4)
  with pytest.warns(UserWarning, match="Dropped them"):
    cfg0, params0 = hf.load(path, missing_mtp="drop")
  assert cfg0.num_nextn_predict_layers == 0 and "mtp" not in params0
  with pytest.raises(ValueError, match=r"model\.layers\.2\.\* is MTP module 0 .*missing_mtp='init'"):
    hf.load(path, missing_mtp="error")
  with pytest.raises(ValueError, match="missing_mtp='bogus'; valid"):
    hf.load(path, missing_mtp="bogus")
