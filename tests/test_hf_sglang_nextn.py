"""The MTP layer of a saved checkpoint as SGLang's DeepSeek NextN (MTP/EAGLE draft) loader reads it: the layer index,
the names it maps, their shapes and values. SGLang's rules are read from the installed SGLang's loader source (its
import needs the GPU stack), so a change there fails this test instead of a GPU fleet's start."""
import functools
import importlib.util
import os
import re

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from composer_jax.interop import hf
from composer_jax.model import ModelConfig, init

CFG = ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, initializer_range=0.1, max_position_embeddings=64,
                  num_nextn_predict_layers=1)


@functools.cache
def sglang_nextn_rules() -> tuple[str, ...]:
  """The NextN-specific weight names of the installed SGLang's DeepSeek loader, after checking the rest of the rules
  this test applies (layer index, prefix, shared tensors skipped) are still the ones in its source."""
  spec = importlib.util.find_spec("sglang")
  if spec is None:
    pytest.skip("sglang is not installed (make test installs its CPU build)")
  path = os.path.join(os.path.dirname(spec.origin), "srt", "models", "deepseek_common", "deepseek_weight_loader.py")
  src = open(path).read()
  for rule in ("0 if self.config.num_hidden_layers == 1 else self.config.num_hidden_layers",
               'nextn_layer_prefix=f"model.layers.{nextn_layer_id}"',
               'if "shared_head.head" in name or "embed_tokens" in name:',
               'name = name.replace(layer_prefix, "model")', 'name = name.replace(layer_prefix, "model.decoder")'):
    assert rule in src, f"SGLang's NextN loader changed ({path}): no {rule!r}"
  names = re.search(r"nextn_spec_weight_names=\[(.*?)\]", src, re.S).group(1)
  return tuple(re.findall(r'"([^"]+)"', names))


def sglang_name(name: str, num_hidden_layers: int) -> str | None:
  """What SGLang's NextN loader makes of checkpoint tensor `name`: its module name, or None (not read)."""
  layer = 0 if num_hidden_layers == 1 else num_hidden_layers
  prefix = f"model.layers.{layer}"
  if not name.startswith(prefix + ".") or "shared_head.head" in name or "embed_tokens" in name:
    return None
  if any(s in name for s in sglang_nextn_rules()):
    return name.replace(prefix, "model")
  return name.replace(prefix, "model.decoder")


def test_saved_mtp_layer_is_what_sglangs_nextn_loader_reads(tmp_path):
  params = init(jax.random.key(0), CFG)
  hf.save(str(tmp_path), CFG, params)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  read = {sglang_name(n, CFG.num_hidden_layers): n for n in tensors if sglang_name(n, CFG.num_hidden_layers)}
  D = CFG.hidden_size
  own = {"model.enorm.weight": (D,), "model.hnorm.weight": (D,), "model.eh_proj.weight": (D, 2 * D),
         "model.shared_head.norm.weight": (D,)}
  assert {k: tensors[read[k]].shape for k in own} == own
  # The decoder is a MoE layer named as the trunk's (layer 1 here): same names and shapes.
  trunk = {n.replace("model.layers.1.", "model.decoder."): tensors[n].shape for n in tensors
           if n.startswith("model.layers.1.")}
  assert {k: tensors[n].shape for k, n in read.items() if k.startswith("model.decoder.")} == trunk
  assert set(read) == set(own) | set(trunk)
  # Values: SGLang computes eh_proj(cat[enorm(embed), hnorm(hidden)]), nn.Linear [out, in] = our [in, out]ᵀ.
  mtp = jax.tree.map(lambda x: np.asarray(x[0]), params["mtp"])
  np.testing.assert_array_equal(tensors[read["model.eh_proj.weight"]], mtp["eh_proj"].T)
  np.testing.assert_array_equal(tensors[read["model.enorm.weight"]], mtp["enorm"])
  np.testing.assert_array_equal(tensors[read["model.shared_head.norm.weight"]], mtp["norm"])
  # The copies SGLang skips (it shares the target model's) are the trunk's.
  np.testing.assert_array_equal(tensors["model.layers.2.embed_tokens.weight"], np.asarray(params["embed"]))


def test_a_trained_mtp_layer_round_trips(tmp_path):
  params = init(jax.random.key(0), CFG)
  params["mtp"] = jax.tree.map(lambda x: x + 0.25, params["mtp"])   # moved off init, as RL moves it
  hf.save(str(tmp_path), CFG, params)
  cfg, got = hf.load(str(tmp_path))
  assert cfg.num_nextn_predict_layers == 1
  jax.tree.map(np.testing.assert_array_equal, got["mtp"], params["mtp"])
