"""``nostatic``: a policy registered only inside :func:`no_static_policy`, StreamingLLM without a static store.

Every built-in policy has a static store, so what kvkit does for one that has none (a third-party policy; a policy
whose static variant is not written yet) is tested on this one: ``KVCache(..., static=True)`` refuses it with its
store's ``compile_refusal``, the GPU bench gives it no compiled row and says why, ``cache_implementation="static"``
is refused."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import pytest

from kvkit import registry, testing
from kvkit.policies.streaming import Streaming, StreamingStore

NAME = "nostatic"


@dataclass(frozen=True)
class NoStatic(Streaming):
    """Streaming whose stores are always the growing ones."""

    static_capable: ClassVar[bool] = False
    description = "test only: streaming without a static store"

    def new_layer(self, info):
        return StreamingStore(info, self.budget, self.sink, self.tail)


@contextlib.contextmanager
def no_static_policy():
    """``nostatic`` is a registered policy inside the block (and only there: the registry is restored)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry._REGISTRY, NAME, NoStatic)
        mp.setattr(NoStatic, "name", NAME, raising=False)
        mp.setitem(testing.TEST_OPTIONS, NAME, testing.TEST_OPTIONS["streaming"])
        yield NAME
