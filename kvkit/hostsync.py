"""Count host synchronisations on any device, the CPU included: what would stall a GPU decode step.

A GPU step stalls the host when Python needs a device value: ``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``,
``torch.equal``, or an op whose output *shape* depends on the data (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``). On the CPU these cost nothing, so they
go unnoticed there; :class:`HostSyncCounter` records every one of them (with the caller's file:line) whatever the
device, so the rule "a decode step makes no host synchronisation" is checked in CI without a GPU.

Usage::

    with HostSyncCounter() as syncs:
        model(next_token, **cache_kw(cache), use_cache=True)  # kvkit.compat.cache_kw
    syncs.count, syncs.where()   # e.g. 0, Counter()

Mechanism: a ``TorchDispatchMode`` sees every aten op (``_local_scalar_dense`` is what ``item`` / ``bool`` / ``int`` /
``float`` run; boolean indices arrive as ``index.Tensor`` with a bool index); ``Tensor.tolist`` bypasses the
dispatcher and is wrapped for the duration of the block.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

#: ops that always need the device value on the host
_ALWAYS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.allclose.default,
}


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _is_sync(func, args, kwargs) -> bool:
    if func in _ALWAYS:
        return True
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
    if name in ("index", "_index_put_impl_", "index_put", "index_put_"):
        return _bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None and (
            len(args) < 4 or args[3] is None)
    return False


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module (relative to the working directory)."""
    for fr in reversed(traceback.extract_stack()):
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or f.endswith("hostsync.py"):
            continue
        if "/site-packages/" in f:
            f = f.split("/site-packages/")[-1]
        elif os.path.isabs(f) and f.startswith(os.getcwd() + os.sep):
            f = os.path.relpath(f)
        return f"{f}:{fr.lineno}"
    return "?"


class HostSyncCounter(TorchDispatchMode):
    """Context manager counting host synchronisations (see the module docstring); ``count``, ``calls``
    (``[(op, file:line)]``) and ``where()`` (a Counter of file:line) afterwards."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.calls.append((str(func), _caller()))
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(t, *a, **k):
            counter.calls.append(("Tensor.tolist", _caller()))
            return counter._tolist(t, *a, **k)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.calls)

    def where(self) -> Counter:
        return Counter(w for _, w in self.calls)
