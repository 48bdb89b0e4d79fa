"""StreamingLLM memory in vLLM: a KV-cache spec whose manager frees the middle blocks.

``KvkitStreamingSpec`` is a ``FullAttentionSpec`` (same page bytes, grouped with full attention)
carrying the number of sink blocks and recent blocks. The backend's ``customize_spec`` returns it
under ``streaming:free=1``; vLLM's KV-cache spec registry maps it to ``KvkitStreamingManager``.

The manager keeps every block while the prompt is being prefilled (prefill is exact full
attention, as in kvkit's transformers policy). Once the prompt is processed, before each step it
frees the blocks between the sinks and the recent window, replacing them by vLLM's null block as
the sliding-window manager does. The freeing bound matches what the attention reads: a decode
step whose query is token ``n`` (``processed = n`` tokens already in the cache) reads the sink
blocks and blocks ``[nb - recent, nb)`` with ``nb = n // block_size + 1``; the manager frees
``[sink, nb - recent)`` computed from the *processed* token count, which lags the scheduled count
under async scheduling, so it never frees a block that a scheduled step still reads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclass(frozen=True, kw_only=True)
class KvkitStreamingSpec(FullAttentionSpec):
    sink_blocks: int = 0
    recent_blocks: int = 1

    @classmethod
    def merge(cls, specs):
        assert all(isinstance(s, KvkitStreamingSpec) for s in specs), "kvkit streaming layers mixed with others"
        geometry = {(s.sink_blocks, s.recent_blocks) for s in specs}
        assert len(geometry) == 1, f"kvkit streaming layers disagree on sink/recent blocks: {geometry}"
        base = FullAttentionSpec.merge(specs)
        sink_blocks, recent_blocks = geometry.pop()
        return cls(**{f.name: getattr(base, f.name) for f in fields(base)},
                   sink_blocks=sink_blocks, recent_blocks=recent_blocks)

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, sink_blocks: int, recent_blocks: int) -> KvkitStreamingSpec:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)},
                   sink_blocks=sink_blocks, recent_blocks=recent_blocks)


class KvkitStreamingManager(FullAttentionManager):
    """Full attention while the prompt is prefilled; sinks + a recent window of blocks afterwards."""

    def __init__(self, kv_cache_spec: KvkitStreamingSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sink_blocks = kv_cache_spec.sink_blocks
        self.recent_blocks = kv_cache_spec.recent_blocks

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None) -> None:
        if num_prompt_tokens is None or processed_computed_tokens < num_prompt_tokens:
            return  # still prefilling the prompt: prefill reads everything
        first_read = processed_computed_tokens // self.block_size + 1 - self.recent_blocks
        self._remove_blocks_in_range(request_id, self.sink_blocks, first_read)


def register_specs() -> None:
    """Register the spec with vLLM's registry (after vLLM's built-ins, which the registry skips otherwise)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KvkitStreamingSpec, KvkitStreamingManager, uniform_type_base_spec=FullAttentionSpec)
