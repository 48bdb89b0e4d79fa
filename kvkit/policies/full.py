"""``full``: no compression. The reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvkit.policies.base import Policy
from kvkit.registry import register
from kvkit.stores import FullStore, LayerInfo
from kvkit.stores.full import StaticFullStore


@register("full")
@dataclass(frozen=True)
class Full(Policy):
    """Keep every token; attention is transformers' own sdpa (bit-identical to the unpatched model).

    In a static cache (``kvkit.patch(model, "full", static=True)``) the layers are
    :class:`~kvkit.stores.full.StaticFullStore`: preallocated, written at an index tensor, compileable."""

    static_capable: ClassVar[bool] = True
    description = "no compression; identical outputs to the unpatched model (baseline)"
    saves = "nothing"
    covering_options: ClassVar[dict | None] = {}

    def new_layer(self, info: LayerInfo):
        return StaticFullStore(info, capacity=info.max_length) if info.static else FullStore(info)
