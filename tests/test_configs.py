"""The one ConfigDict → dataclass converter: nesting, tuples, optional sections, and errors that name the key."""
import dataclasses

import ml_collections
import pytest

from composer_jax import configs
from composer_jax.model.config import ModelConfig, RopeScaling


@dataclasses.dataclass(frozen=True)
class Inner:
  a: int = 1
  b: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Outer:
  inner: Inner = Inner()
  maybe: Inner | None = None
  name: str = "x"


def test_nested_mapping_becomes_nested_dataclasses():
  c = ml_collections.ConfigDict(dict(inner=dict(a=2, b=[3, 4]), maybe=dict(a=5), name="y"))
  got = configs.from_dict(Outer, c)
  assert got == Outer(Inner(2, (3, 4)), Inner(5), "y")
  assert configs.from_dict(Outer, {"maybe": None}).maybe is None
  assert configs.from_dict(Outer, {}) == Outer()
  assert configs.from_dict(Outer, got) is got                                   # already converted
  assert configs.from_dict(Outer, configs.to_dict(got)) == got                  # round trip


def test_unknown_keys_name_their_path_and_the_valid_ones():
  with pytest.raises(ValueError, match=r"inner\.c for Inner; valid keys: \['a', 'b'\]"):
    configs.from_dict(Outer, {"inner": {"c": 1}})
  with pytest.raises(ValueError, match=r"unknown config key\(s\) nmae for Outer"):
    configs.from_dict(Outer, {"nmae": "z"})
  with pytest.raises(TypeError, match="must be a mapping"):
    configs.from_dict(Outer, {"inner": 3})


def test_replace_takes_dotted_paths():
  got = configs.replace(Outer(), **{"inner.a": 7, "name": "q"})
  assert got == Outer(Inner(7), None, "q")
  with pytest.raises(ValueError, match="'name' is not a section"):
    configs.replace(Outer(), **{"name.x": 1})
  with pytest.raises(ValueError, match="inner.z"):
    configs.replace(Outer(), **{"inner.z": 1})


def test_model_config_with_rope_scaling():
  from experiments.configs import model as model_configs
  cfg = configs.from_dict(ModelConfig, model_configs.get_config("kimi_k2"))
  assert isinstance(cfg.rope_scaling, RopeScaling) and cfg.rope_scaling.factor == 32.0
  with pytest.raises(ValueError, match=r"rope_scaling\.fator"):
    configs.from_dict(ModelConfig, {"rope_scaling": {"fator": 2.0}})
