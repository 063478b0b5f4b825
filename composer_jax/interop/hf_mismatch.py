"""Which config.json fields disagree with a checkpoint's tensors, read off a few tensors whose dimensions are single
fields (a mis-set `hidden_size` mis-shapes nearly every tensor; the list of them does not say which number is wrong).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection

from composer_jax.model.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _anchors(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
  """Tensor name → the config field of each axis (None: an axis that is no single field)."""
  moe = cfg.first_k_dense_replace
  out = {"model.embed_tokens.weight": ("vocab_size", "hidden_size"), "model.norm.weight": ("hidden_size",),
         "model.layers.0.self_attn.kv_a_layernorm.weight": ("kv_lora_rank",),
         "model.layers.0.self_attn.q_a_layernorm.weight": ("q_lora_rank",),
         f"model.layers.{moe}.mlp.gate.weight": ("n_routed_experts", "hidden_size"),
         f"model.layers.{moe}.mlp.experts.0.gate_proj.weight": ("moe_intermediate_size", "hidden_size")}
  if cfg.first_k_dense_replace:
    out["model.layers.0.mlp.gate_proj.weight"] = ("intermediate_size", "hidden_size")
  return out


def disagreements(cfg: ModelConfig, names: Collection[str], shape: Callable[[str], tuple[int, ...]]) -> list[str]:
  """'config.json FIELD=V, but TENSOR has N' for each field a present anchor tensor contradicts (one line a field),
  and a line when the decoder layers present are not 0 .. num_hidden_layers - 1."""
  seen: dict[str, str] = {}
  for name, fields in _anchors(cfg).items():
    if name not in names:
      continue
    got = shape(name)
    for axis, field in enumerate(fields):
      want = getattr(cfg, field)
      if axis < len(got) and want is not None and got[axis] != want and field not in seen:
        seen[field] = f"config.json {field}={want}, but {name} has {got[axis]} on axis {axis} (shape {got})"
  lines = list(seen.values())
  layers = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
  mtp = {i for i in layers if f"model.layers.{i}.eh_proj.weight" in names}  # MTP modules carry an eh_proj
  decoder = sorted(layers - mtp)
  if decoder and decoder != list(range(cfg.num_hidden_layers)):
    lines.append(f"config.json num_hidden_layers={cfg.num_hidden_layers}, but the tensors hold decoder layers "
                 f"{decoder[0]}..{decoder[-1]} ({len(decoder)} layers)" +
                 (f" and MTP modules at {sorted(mtp)}" if mtp else ""))
  return lines
