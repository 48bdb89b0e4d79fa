"""Stores: what policies are built from (see docs/DESIGN.md). Import from here, not from the submodules."""

from kvkit.stores.attend import attend_slots, causal_suffix_attention, hf_sdpa, plain_sdpa_call
from kvkit.stores.base import LayerInfo, SlotStore
from kvkit.stores.buffers import crop_count
from kvkit.stores.full import FullStore, SlidingStore
from kvkit.stores.layer import StoreMixin, tensor_bytes
from kvkit.stores.quantized import QuantizedSegmentStore
from kvkit.stores.scored import ScoredStore

__all__ = [
    "LayerInfo", "StoreMixin", "SlotStore", "FullStore", "SlidingStore", "tensor_bytes", "crop_count",
    "attend_slots", "causal_suffix_attention", "hf_sdpa", "plain_sdpa_call", "QuantizedSegmentStore", "ScoredStore",
]
