"""A cache filled under ``torch.inference_mode()`` and used outside it: its inference tensors made normal ones.

PyTorch forbids in-place writes to an inference tensor outside inference mode, and kvkit's stores write in place
(append buffers, static slot buffers and counters, padding marks, saliency sums, slot segments). transformers'
``DynamicCache`` never writes in place (it concatenates); kvkit instead copies, once, every inference tensor a
cache holds into a normal tensor before its first write outside inference mode (:func:`to_normal_tensors`, called
by ``KVCache``).

Views stay views: tensors that share a storage (a store's held prefix and its preallocated buffer, a static store's
slot segments and the stacked area they are rows of) share the one copy of that storage, at their own sizes,
strides and offsets, so writes through one still reach the others.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import CacheLayerMixin

from kvkit.model_info import LayerInfo


def _owned_by_kvkit(obj) -> bool:
    """Objects whose attributes may hold a cache's tensors: every store (a third-party policy's too) and kvkit's own
    classes (packed blocks, segments, the policies' shared state), not policies (frozen options), layer infos (the
    model's config and rotary embedding) or modules. A policy is known by what it builds (``new_layer`` and
    ``new_shared``): the stores sit below the policies and import none of them."""
    if isinstance(obj, CacheLayerMixin):
        return True
    module = type(obj).__module__ or ""
    policy = hasattr(type(obj), "new_layer") and hasattr(type(obj), "new_shared")
    return (module.startswith("kvkit.") and not policy and not isinstance(obj, (type, LayerInfo, torch.nn.Module))
            and (hasattr(obj, "__dict__") or dataclasses.is_dataclass(obj)))


class _Normalizer:
    def __init__(self):
        self.storages: dict = {}  # (storage address, dtype) -> a normal flat copy of that storage
        self.visited: set = set()
        self.changed = False
        self.static: list = []  # static stores: their new buffers get fixed addresses (CUDA graphs)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_inference():
            return t
        self.changed = True
        key = (t.untyped_storage().data_ptr(), t.dtype, t.device)
        flat = self.storages.get(key)
        if flat is None:
            n = t.untyped_storage().nbytes() // t.element_size()
            flat = self.storages[key] = t.as_strided((n,), (1,), 0).clone()
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())

    def value(self, x):
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if isinstance(x, (list, dict)) or _owned_by_kvkit(x):
            self.walk(x)
            return x
        if isinstance(x, tuple):
            items = [self.value(v) for v in x]
            if all(a is b for a, b in zip(items, x)):
                return x
            return type(x)._make(items) if hasattr(type(x), "_fields") else type(x)(items)
        return x

    def walk(self, obj) -> None:
        if id(obj) in self.visited:
            return
        self.visited.add(id(obj))
        if hasattr(obj, "_mark_static"):
            self.static.append(obj)
        if isinstance(obj, list):
            obj[:] = [self.value(v) for v in obj]
        elif isinstance(obj, dict):
            for k in list(obj):
                obj[k] = self.value(obj[k])
        else:
            names = (list(vars(obj)) if hasattr(obj, "__dict__")
                     else [f.name for f in dataclasses.fields(obj)])
            for name in names:
                old = getattr(obj, name)
                new = self.value(old)
                if new is not old:
                    object.__setattr__(obj, name, new)  # frozen dataclasses (packed blocks) included


def to_normal_tensors(*roots) -> bool:
    """Replace, in place, every inference tensor reachable from ``roots`` (stores, their containers and kvkit's
    own objects) by a normal tensor with the same contents, views sharing one copy of their storage. Returns
    whether anything was replaced. Run it outside inference mode (eager: it copies each such storage once)."""
    n = _Normalizer()
    for root in roots:
        n.value(root)
    if n.changed:
        for store in n.static:
            store._mark_static()
    return n.changed
