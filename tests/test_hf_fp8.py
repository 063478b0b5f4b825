"""Block-FP8 checkpoints in the DeepSeek-V3 / Kimi K2 layout: `save(fp8=True)` writes it, `load` dequantises it.

The reference dequantises the written file independently (torch: `W_fp8.float() * scale_inv` repeated over each
128 x 128 block, cut at the edges), on shapes that are not multiples of 128 so every edge block is partial.
"""
import dataclasses
import functools
import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from composer_jax.interop import fp8 as fp8_lib
from composer_jax.interop import hf
from composer_jax.model import ModelConfig, forward, init

torch = pytest.importorskip("torch", reason="torch is the test-only reference implementation")
from safetensors.torch import load_file as torch_load_file  # noqa: E402

# hidden 136, kv_lora 144, dense ffw 200, expert ffw 72, heads x q dim 2 x 12: edge blocks of 8, 16, 72, 24 ...
CFG = ModelConfig(vocab_size=150, hidden_size=136, intermediate_size=200, moe_intermediate_size=72,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=None,
                  kv_lora_rank=144, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, initializer_range=0.1, max_position_embeddings=64)


@functools.cache
def _params():
  return jax.device_get(init(jax.random.key(0), CFG))


def _dequantised_reference(src: str, dst: str) -> None:
  """A plain float32 checkpoint holding torch's dequantisation of every FP8 weight in `src`."""
  t = torch_load_file(os.path.join(src, hf.SINGLE_FILE))
  out = {}
  for name, w in t.items():
    if name.endswith("_scale_inv"):
      continue
    if w.dtype == torch.float8_e4m3fn:
      s = t[name + "_scale_inv"]
      full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
      w = w.float() * full
    out[name] = w.float().numpy()
  os.makedirs(dst)
  save_file(out, os.path.join(dst, hf.SINGLE_FILE))
  d = json.load(open(os.path.join(src, "config.json")))
  del d["quantization_config"]
  json.dump(d, open(os.path.join(dst, "config.json"), "w"))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("fp8") / "ckpt")
  hf.save(path, CFG, _params(), fp8=True)
  return path


def test_written_layout_matches_the_published_one(fp8_dir):
  d = json.load(open(os.path.join(fp8_dir, "config.json")))
  assert d["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}
  t = torch_load_file(os.path.join(fp8_dir, hf.SINGLE_FILE))
  kv_b = "model.layers.0.self_attn.kv_b_proj.weight"            # [2 * 16, 144]
  assert t[kv_b].dtype == torch.float8_e4m3fn and t[kv_b + "_scale_inv"].shape == (1, 2)
  down = "model.layers.1.mlp.experts.3.down_proj.weight"       # [136, 72]
  assert t[down].dtype == torch.float8_e4m3fn and t[down + "_scale_inv"].shape == (2, 1)
  assert t[down + "_scale_inv"].dtype == torch.float32
  for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
               "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.input_layernorm.weight",
               "model.layers.0.self_attn.kv_a_layernorm.weight"):
    assert t[name].dtype == torch.float32 and name + "_scale_inv" not in t, name
  n_fp8 = sum(1 for v in t.values() if v.dtype == torch.float8_e4m3fn)
  # attention (q, kv_a, kv_b, o) x 2 layers, the dense MLP, 4 experts, the shared expert
  assert n_fp8 == sum(1 for k in t if k.endswith("_scale_inv")) == 2 * 4 + 3 + 3 * 4 + 3


def test_load_matches_the_dequantised_reference(fp8_dir, tmp_path):
  ref_dir = str(tmp_path / "ref")
  _dequantised_reference(fp8_dir, ref_dir)
  cfg, params = hf.load(fp8_dir)
  ref_cfg, ref = hf.load(ref_dir)
  assert cfg == ref_cfg == dataclasses.replace(CFG, rope_scaling=cfg.rope_scaling)   # save writes factor-1 YaRN
  # Same float32 products as torch's: bit-exact, not merely close.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, ref)
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, CFG.vocab_size)
  a, _ = forward(params, tokens, cfg)
  b, _ = forward(ref, tokens, cfg)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)
  # E4M3 keeps 3 mantissa bits: each weight is within 2^-4 of its value relative to its block's amax... and closer.
  w, w0 = np.asarray(params["moe_layers"]["moe"]["down"]), _params()["moe_layers"]["moe"]["down"]
  assert np.abs(w - w0).max() <= np.abs(w0).max() * 2.0 ** -4
  # Dequantised to the configured param dtype (bfloat16 here) when config.json says so.
  cfg16, p16 = hf.load(fp8_dir, param_dtype="bfloat16")
  assert p16["moe_layers"]["moe"]["down"].dtype == jax.numpy.bfloat16
  np.testing.assert_array_equal(np.asarray(p16["moe_layers"]["moe"]["down"]), w.astype(jax.numpy.bfloat16))


def test_quantize_round_trips_edge_blocks_exactly():
  """Values already on the E4M3 grid times a per-block power of two survive quantise → dequantise bit-exactly."""
  rng = np.random.default_rng(0)
  fmt = fp8_lib.BlockFP8()
  q0 = rng.normal(size=(130, 257)).astype(fp8_lib.E4M3).astype(np.float32)
  q0[:, 0] = 448.0   # every block row-band has an element at the E4M3 maximum, so the scale is exactly the power
  q0[:, 128], q0[:, 256] = 448.0, 448.0
  scale = 2.0 ** rng.integers(-8, 0, size=(2, 3)).astype(np.float32)
  w = q0 * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:130, :257]
  q, s = fp8_lib.quantize(w, fmt)
  assert q.dtype == fp8_lib.E4M3 and s.shape == (2, 3)
  np.testing.assert_array_equal(s, scale)
  np.testing.assert_array_equal(fp8_lib.dequantize(q, s, fmt, (0, 130), (0, 257)), w)
  # A region read with only its covering scale blocks gives the same values as the whole tensor.
  part = fp8_lib.dequantize(q[100:130, 120:200], s[0:2, 0:2], fmt, (100, 130), (120, 200))
  np.testing.assert_array_equal(part, w[100:130, 120:200])


def _rewrite(path, tensors=None, config=None):
  if tensors is not None:
    save_file(tensors, os.path.join(path, hf.SINGLE_FILE))
  if config is not None:
    json.dump(config, open(os.path.join(path, "config.json"), "w"))


def test_bad_fp8_checkpoints_name_the_tensor_and_the_problem(tmp_path):
  path = str(tmp_path)
  hf.save(path, dataclasses.replace(CFG), _params(), fp8=True)
  good, config = load_file(os.path.join(path, hf.SINGLE_FILE)), json.load(open(os.path.join(path, "config.json")))
  o = "model.layers.1.self_attn.o_proj.weight"   # [136, 16] → scale (2, 1)
  _rewrite(path, {**good, o + "_scale_inv": np.ones((1, 1), np.float32)})
  with pytest.raises(ValueError, match=rf"{o}_scale_inv: got shape \(1, 1\), expected \(2, 1\)"):
    hf.load(path)
  _rewrite(path, {k: v for k, v in good.items() if k != o + "_scale_inv"})
  with pytest.raises(ValueError, match=rf"{o}: FP8 weight without its scale {o}_scale_inv"):
    hf.load(path)
  emb = "model.embed_tokens.weight"
  _rewrite(path, {**good, emb: good[emb].astype(fp8_lib.E4M3)})
  with pytest.raises(ValueError, match=rf"{emb}: stored as float8_e4m3fn, but only attention / MLP"):
    hf.load(path)
  _rewrite(path, {**good, "lm_head.weight_scale_inv": np.ones((2, 2), np.float32)})
  with pytest.raises(ValueError, match=r"lm_head.weight_scale_inv \(a scale for lm_head.weight, which is not FP8\)"):
    hf.load(path)
  _rewrite(path, good, {**config, "quantization_config": {"quant_method": "awq", "bits": 4}})
  with pytest.raises(ValueError, match="quant_method='awq' is unsupported"):
    hf.load(path)
  _rewrite(path, good, {**config, "quantization_config": {**config["quantization_config"], "weight_block_size": None}})
  with pytest.raises(ValueError, match="weight_block_size=None"):
    hf.load(path)
  no_q = dict(config)
  del no_q["quantization_config"]
  _rewrite(path, good, no_q)
  with pytest.raises(ValueError, match="mlp.down_proj.weight: stored as float8_e4m3fn but config.json has no quant"):
    hf.load(path)
