"""kvkit: KV-cache compression policies, sparse/quantized decode kernels and self-speculative
decoding for Hugging Face transformers, installed with one line::

    import kvkit
    kvkit.patch(model, policy="streaming", budget=512)
    model.generate(ids, max_new_tokens=64)
    kvkit.unpatch(model)

    with kvkit.patched(model, "snapkv", compression_ratio=0.5):  # restored on exit
        model.generate(ids, max_new_tokens=64)

The public names are imported on first use (PEP 562 ``__getattr__``), so ``import kvkit`` and the ``kvkit``
command's help and argument checks do not import torch or transformers.
"""

from __future__ import annotations

import importlib
import sys
import types

from kvkit import registry as _registry

# the registry sits below the policies and imports none of them: its first lookup imports the built-in policies
# package, whose modules register themselves
_registry.set_builtin_loader(lambda: importlib.import_module("kvkit.policies"))

__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "patched", "patched_policy", "prefill", "KVCache", "available_policies", "get_policy", "policy_options"]

#: public name -> the module that defines it
_LAZY = {"KVCache": "kvkit.cache", "patch": "kvkit.patch", "patched": "kvkit.patch", "patched_policy": "kvkit.patch", "unpatch": "kvkit.patch",
         "prefill": "kvkit.prefill", "available_policies": "kvkit.registry", "get_policy": "kvkit.registry",
         "policy_options": "kvkit.registry"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvkit' has no attribute {name!r}")


class _Package(types.ModuleType):
    """kvkit's module type: ``kvkit.patch`` and ``kvkit.prefill`` name the functions, as they did when this package
    imported them eagerly, even after their submodules (``kvkit/patch``, ``kvkit/prefill.py``) are imported (the
    import system sets a submodule as an attribute of its package; those submodules stay in ``sys.modules``)."""

    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            self.__dict__.pop(name, None)  # resolved again (to the function) by __getattr__
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__():
    return sorted([*globals(), *_LAZY])
