"""Our `save` → transformers `from_pretrained`, `load(save(x))` exactness, sharding, and bad-checkpoint errors."""
import dataclasses
import functools
import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from composer_jax.interop import hf
from composer_jax.interop.hf_names import expected_shapes
from composer_jax.model import ModelConfig, RopeScaling, abstract_params, forward, init

torch = pytest.importorskip("torch", reason="torch is the test-only reference implementation")
transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference implementation")

CFG = ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, initializer_range=0.1,
                  max_position_embeddings=64,
                  rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16, mscale_all_dim=1.0),
                  num_nextn_predict_layers=1)


@functools.cache
def _params(cfg=CFG):
  p = init(jax.random.key(0), cfg)
  p["moe_layers"]["moe"]["bias"] = 0.1 * jax.random.normal(jax.random.key(1), p["moe_layers"]["moe"]["bias"].shape)
  return p


def _tokens():
  return jax.random.randint(jax.random.key(3), (2, 16), 0, CFG.vocab_size)


def test_save_then_transformers_from_pretrained(tmp_path):
  hf.save(str(tmp_path), CFG, _params())
  d = json.load(open(tmp_path / "config.json"))
  # What SGLang's DeepSeek-V3 loader needs beyond what transformers writes: a YaRN rope_scaling (its CPU rope
  # factory has no other) and the MoE keys real DeepSeek-V3/Kimi configs carry (moe_layer_freq, topk_method, ...).
  assert d["rope_scaling"]["type"] == "yarn" and d["moe_layer_freq"] == 1
  assert d["topk_method"] == "noaux_tc" and d["scoring_func"] == "sigmoid" and d["num_nextn_predict_layers"] == 1
  assert d["architectures"] == ["DeepseekV3ForCausalLM"] and d["torch_dtype"] == "float32"
  model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
  tok = _tokens()
  with torch.no_grad():
    ref = model(torch.tensor(np.array(tok))).logits.numpy()
  # e_score_correction_bias is a buffer in HF: check it really came through.
  np.testing.assert_array_equal(model.model.layers[1].mlp.gate.e_score_correction_bias.numpy(),
                                np.asarray(_params()["moe_layers"]["moe"]["bias"][0]))
  logits, _ = jax.jit(functools.partial(forward, cfg=CFG))(_params(), tok)
  np.testing.assert_allclose(np.asarray(logits), ref, rtol=0, atol=1e-4)  # float32, summation order only


def test_yarn_identity_without_rope_scaling(tmp_path):
  """With no rope scaling, save writes a factor-1 YaRN block (for SGLang) that is numerically plain RoPE."""
  cfg = dataclasses.replace(CFG, rope_scaling=None, num_nextn_predict_layers=0)
  params = {k: v for k, v in _params().items() if k != "mtp"}
  hf.save(str(tmp_path), cfg, params)
  cfg2, params2 = hf.load(str(tmp_path))
  assert cfg2.rope_scaling.factor == 1.0
  tok = _tokens()
  a, _ = forward(params, tok, cfg)
  b, _ = forward(params2, tok, cfg2)
  np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_load_save_bit_exact_and_sharded(tmp_path):
  for sub, max_bytes in (("one", 2**30), ("many", 20_000)):
    path = str(tmp_path / sub)
    hf.save(path, CFG, _params(), max_shard_bytes=max_bytes)
    if sub == "many":
      index = json.load(open(os.path.join(path, hf.INDEX_FILE)))
      assert len(set(index["weight_map"].values())) > 3
      assert set(index["weight_map"]) == set(expected_shapes(CFG))
    cfg, params = hf.load(path)
    assert cfg == CFG
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, _params())
  # Dropping the MTP modules on load is allowed (the trunk is unchanged).
  cfg0, params0 = hf.load(str(tmp_path / "one"), num_nextn_predict_layers=0)
  assert cfg0 == dataclasses.replace(CFG, num_nextn_predict_layers=0) and "mtp" not in params0
  np.testing.assert_array_equal(np.asarray(params0["embed"]), np.asarray(_params()["embed"]))
  # bfloat16 params round-trip bit-exactly too (config.json records torch_dtype).
  cfg16 = dataclasses.replace(CFG, param_dtype="bfloat16")
  # Cast to the dtypes the description gives (router weight and bias stay float32).
  p16 = jax.tree.map(lambda a, s: (a * 1.1).astype(s.dtype), _params(), abstract_params(cfg16))
  assert p16["embed"].dtype == jax.numpy.bfloat16 and p16["moe_layers"]["moe"]["router"].dtype == np.float32
  hf.save(str(tmp_path / "bf16"), cfg16, p16)
  cfg, params = hf.load(str(tmp_path / "bf16"))
  assert cfg == cfg16
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, p16)
  names = load_file(os.path.join(tmp_path, "one", hf.SINGLE_FILE))
  n = CFG.num_hidden_layers
  for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "mlp.experts.3.down_proj.weight", "self_attn.q_a_proj.weight"):
    assert f"model.layers.{n}.{s}" in names
  assert names[f"model.layers.{n}.eh_proj.weight"].shape == (32, 64)
  assert names["model.layers.1.mlp.experts.2.gate_proj.weight"].shape == (16, 32)


def test_bad_checkpoints_raise_clear_errors(tmp_path):
  path = str(tmp_path)
  hf.save(path, CFG, _params())
  file = os.path.join(path, hf.SINGLE_FILE)
  good = load_file(file)
  bad = dict(good)
  del bad["model.layers.1.mlp.experts.3.up_proj.weight"]
  bad["model.layers.1.mlp.experts.9.up_proj.weight"] = good["model.layers.1.mlp.experts.0.up_proj.weight"]
  bad["model.norm.weight"] = np.ones(31, np.float32)
  save_file(bad, file)
  with pytest.raises(ValueError) as e:
    hf.load(path)
  msg = str(e.value)
  assert "missing 1 tensor(s):\n  model.layers.1.mlp.experts.3.up_proj.weight" in msg
  assert "unexpected 1 tensor(s):\n  model.layers.1.mlp.experts.9.up_proj.weight" in msg
  assert "model.norm.weight: got (31,), expected (32,)" in msg
  # A config.json the model cannot represent fails naming the key.
  save_file(good, file)
  d = json.load(open(os.path.join(path, "config.json")))
  json.dump({**d, "scoring_func": "softmax"}, open(os.path.join(path, "config.json"), "w"))
  with pytest.raises(ValueError, match="scoring_func='softmax' is unsupported"):
    hf.load(path)
  json.dump(d, open(os.path.join(path, "config.json"), "w"))
  os.remove(file)
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    hf.load(path)


def test_partial_mtp_module_is_an_error(tmp_path):
  path = str(tmp_path)
  hf.save(path, CFG, _params())
  file = os.path.join(path, hf.SINGLE_FILE)
  tensors = load_file(file)
  del tensors["model.layers.2.eh_proj.weight"]
  save_file(tensors, file)
  with pytest.raises(ValueError) as e:
    hf.load(path)
  assert "missing 1 tensor(s):\n  model.layers.2.eh_proj.weight" in str(e.value)
  assert "model.layers.2.* is MTP module 0" in str(e.value) and "a partial one cannot" in str(e.value)


def test_one_of_two_mtp_modules_missing(tmp_path):
  """Module 1 absent: 'init' keeps module 0 as saved and initialises module 1; 'drop' keeps only module 0; with
  module 0 absent instead, 'drop' cannot (a count of modules can only lose the trailing ones)."""
  cfg = dataclasses.replace(CFG, num_nextn_predict_layers=2)
  params = init(jax.random.key(5), cfg)
  path = str(tmp_path)
  hf.save(path, cfg, params)
  file = os.path.join(path, hf.SINGLE_FILE)
  full = load_file(file)
  save_file({k: v for k, v in full.items() if not k.startswith("model.layers.3.")}, file)
  with pytest.warns(UserWarning, match=r"MTP module\(s\) 1 \(model\.layers\.3\.\*\)"):
    got_cfg, got = hf.load(path, seed=3)
  assert got_cfg == cfg
  for a, b in zip(jax.tree.leaves(got["mtp"]), jax.tree.leaves(params["mtp"])):
    np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
  fresh = np.asarray(got["mtp"]["eh_proj"][1])
  assert np.abs(fresh).max() > 0 and not np.array_equal(fresh, np.asarray(params["mtp"]["eh_proj"][1]))
  with pytest.warns(UserWarning, match="Dropped them"):
    cfg1, p1 = hf.load(path, missing_mtp="drop")
  assert cfg1.num_nextn_predict_layers == 1 and p1["mtp"]["eh_proj"].shape[0] == 1
  save_file({k: v for k, v in full.items() if not k.startswith("model.layers.2.")}, file)
  with pytest.raises(ValueError, match="can only drop trailing modules"):
    hf.load(path, missing_mtp="drop")
