"""Bad checkpoint directories fail with one error naming the file or the config.json field: a truncated or corrupt
safetensors file, an index naming an absent shard, a config.json that is not JSON, and a config.json whose sizes
disagree with the tensors (the field is named, not only the ~all mis-shaped tensors it causes), a checkpoint's
tokenizer.json with more ids than its config.json vocab_size."""
import dataclasses
import glob
import json
import os
import sysconfig

import jax
import pytest
from hf_checkpoint_testlib import deepseek_tokenizer
from safetensors import safe_open

from composer_jax.interop import hf, start
from composer_jax.model import ModelConfig, init

CFG = ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, max_position_embeddings=64,
                  num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ckpt"))
  hf.save(path, CFG, init(jax.random.key(0), CFG))
  return path


def _copy(saved, tmp_path, config_edit=None) -> str:
  dst = str(tmp_path / "c")
  os.makedirs(dst)
  for name in os.listdir(saved):
    with open(os.path.join(saved, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
      g.write(f.read())
  if config_edit:
    d = json.load(open(os.path.join(dst, "config.json")))
    json.dump({**d, **config_edit}, open(os.path.join(dst, "config.json"), "w"))
  return dst


@pytest.mark.parametrize("keep", [20, 200, -64])  # cut in the header length, in the header, in the data
def test_a_truncated_safetensors_file_is_named(saved, tmp_path, keep):
  path = _copy(saved, tmp_path)
  file = os.path.join(path, hf.SINGLE_FILE)
  data = open(file, "rb").read()
  open(file, "wb").write(data[:keep])
  with pytest.raises(ValueError, match=f"{file}: not a readable safetensors file .*truncated or corrupt"):
    hf.load(path)


def test_an_index_naming_an_absent_shard(saved, tmp_path):
  path = _copy(saved, tmp_path)
  os.rename(os.path.join(path, hf.SINGLE_FILE), os.path.join(path, "model-00001-of-00002.safetensors"))
  with safe_open(os.path.join(saved, hf.SINGLE_FILE), framework="np") as f:
    weight_map = dict.fromkeys(f.keys(), "model-00001-of-00002.safetensors")
  weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
  json.dump({"weight_map": weight_map}, open(os.path.join(path, hf.INDEX_FILE), "w"))
  with pytest.raises(FileNotFoundError, match=r"names 1 file\(s\) that are not in .*model-00002-of-00002"):
    hf.load(path)


def test_config_json_not_json(saved, tmp_path):
  path = _copy(saved, tmp_path)
  open(os.path.join(path, "config.json"), "w").write('{"hidden_size": 32,')
  with pytest.raises(ValueError, match=r"config.json: not JSON \(Expecting property name"):
    hf.load(path)


@pytest.mark.parametrize("edit, says", [
  ({"hidden_size": 64}, "config.json hidden_size=64, but model.embed_tokens.weight has 32 on axis 1 (shape (80, 32))"),
  ({"n_routed_experts": 8}, "config.json n_routed_experts=8, but model.layers.1.mlp.gate.weight has 4 on axis 0"),
  ({"kv_lora_rank": 8}, "config.json kv_lora_rank=8, but model.layers.0.self_attn.kv_a_layernorm.weight has 16"),
  ({"num_hidden_layers": 1}, "config.json num_hidden_layers=1, but the tensors hold decoder layers 0..1 (2 layers)"),
])
def test_a_config_disagreeing_with_its_tensors_names_the_field(saved, tmp_path, edit, says):
  path = _copy(saved, tmp_path, edit)
  with pytest.raises(ValueError) as e:
    hf.load(path)
  msg = str(e.value)
  assert msg.startswith(f"Checkpoint {path} does not match its config.json:\n{says}"), msg
  assert sum(ln.startswith("config.json ") for ln in msg.splitlines()) == 1  # one line for the one field


def test_a_checkpoint_tokenizer_with_more_ids_than_the_embedding(tmp_path):
  """The checkpoint's own tokenizer.json must fit its config.json vocab_size (growing the embedding for the
  chat-format tokens added later is fine; a tokenizer that never fitted is another model's)."""
  texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(
    os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))]
  small = dataclasses.replace(CFG, vocab_size=320)
  path = str(tmp_path / "ckpt")
  hf.save(path, small, init(jax.random.key(0), small))
  deepseek_tokenizer(path, texts, vocab_size=300)   # fits: 300 ids, 320 rows
  cfg, _, _ = start.from_hf(path, small, min_vocab=300)
  assert cfg.vocab_size == 320
  deepseek_tokenizer(path, texts, vocab_size=330)
  with pytest.raises(ValueError, match=rf"^{path}/tokenizer.json has 330 token ids \(the largest 329\), but the "
                                       rf"model's embedding has 320 rows \({path}/config.json vocab_size=320\)"):
    start.from_hf(path, small, min_vocab=330)
