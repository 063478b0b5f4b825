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


@dataclasses.dataclass(frozen=True)
class WithOptional:
  inner: Inner = Inner()
  scale: float | None = None
  steps: int = 3


def test_a_config_file_starts_from_the_dataclass_defaults():
  """`common.defaults_of`: every field at its default, sections nested, a None default a placeholder a flag can set;
  `override` takes nested sections and dotted keys, and names a key the config lacks by its whole path."""
  from experiments.configs import common
  c = common.defaults_of(WithOptional)
  assert (c.inner.a, c.inner.b, c.scale, c.steps) == (1, (), None, 3)
  assert configs.from_dict(WithOptional, c) == WithOptional()
  common.override(c, {"inner": {"a": 2}}, {"scale": 0.5, "inner.b": (4,)})
  assert configs.from_dict(WithOptional, c) == WithOptional(Inner(2, (4,)), 0.5, 3)
  assert common.defaults_of(WithOptional, steps=7).steps == 7
  with pytest.raises(KeyError, match="'inner.c': the config has no 'inner.c'"):
    common.override(c, {"inner": {"c": 1}})


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
