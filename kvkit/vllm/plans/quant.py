"""``quant``: packed 4-bit / 8-bit K/V pages in vLLM's paged cache (:mod:`kvkit.vllm.quant`, which holds the format,
the per-step plan and the kernels' calls). Every token is kept and read; the same KV memory holds more tokens.

* spec: the layer's ``FullAttentionSpec`` with ``dtype=uint8`` and the packed page's ``state_content_bytes``;
* writes: the decoder layers' new K/V are quantised into their slots (other attention types: vLLM's write);
* reads: decode rows through the C kernel over the packed pages, prefill rows over a dequantised scratch cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvkit.vllm.plans import register
from kvkit.vllm.plans.base import Plan, require_int


@register("quant")
@dataclass(frozen=True)
class QuantPlan(Plan):
    """bits : bits per K/V code in the packed pages (4 or 8). Plugin-only (no transformers policy of this name)."""

    bits: int = 4

    plugin_options = ("bits",)

    def check(self) -> None:
        require_int(self, "bits")
        if self.bits not in (4, 8):
            raise ValueError(f"kvkit.vllm: bits must be 4 or 8, got {self.bits!r}")

    def customize_spec(self, spec):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        if not isinstance(spec, FullAttentionSpec):
            return spec
        if type(spec) is not FullAttentionSpec:
            raise ValueError(f"kvkit.vllm quant: {type(spec).__name__} layers are not supported")
        from kvkit.vllm.quant import quant_spec

        return quant_spec(spec, self)

    def plan_step(self, builder, md, num_reqs: int, force_full: bool):
        from kvkit.vllm import quant

        return quant.build_plan(builder, md, num_reqs)

    def layer_state(self, impl, ctx) -> bool:
        return ctx.decoder  # only decoder self-attention writes packed pages

    def write(self, impl, state, layer, key, value, kv_cache, slot_mapping) -> None:
        if not state:
            return impl.vllm_write(layer, key, value, kv_cache, slot_mapping)
        from kvkit.vllm import quant

        quant.write(impl, layer, key, value, kv_cache, slot_mapping)

    def forward(self, impl, state, step, layer, query, key, value, kv_cache, md, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvkit.vllm quant: fused output quantization is not supported")
        from kvkit.vllm import quant

        return quant.forward(impl, layer, query, key, value, kv_cache, step, output)
