"""Import-only stand-in for torchvision, so SGLang 0.5.23 starts next to the CPU torch wheel.

SGLang imports torchvision at start-up from its multimodal modules (InternVL, ...). PyPI's torchvision is built
against CUDA torch and breaks next to the CPU torch 2.13 wheel; nothing multimodal is served here, so every
`torchvision.*` submodule resolves to a placeholder whose attributes are placeholders and which raises only when
called. Test-time only (on PYTHONPATH via rollout/engines/sglang_patches).
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+composer-jax-stub"


class _Placeholder:
  """Any attribute is another placeholder; calling one says torchvision is a stub."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str):
    if attr.startswith("__"):
      raise AttributeError(attr)
    return _Placeholder(f"{self._name}.{attr}")

  def __call__(self, *args, **kwargs):
    raise RuntimeError(f"{self._name}: torchvision is an import stub here (multimodal inputs are not supported)")

  def __mro_entries__(self, bases):
    return (object,)


class _StubModule(types.ModuleType):
  def __getattr__(self, attr: str):
    if attr.startswith("__"):
      raise AttributeError(attr)
    return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Serves every `torchvision.<sub>` import with a stub package."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname.startswith(__name__ + "."):
      return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    return None

  def create_module(self, spec):
    module = _StubModule(spec.name)
    module.__path__ = []
    return module

  def exec_module(self, module):
    pass


def __getattr__(attr: str):
  if attr.startswith("__"):
    raise AttributeError(attr)
  return _Placeholder(f"torchvision.{attr}")


sys.meta_path.insert(0, _Finder())
