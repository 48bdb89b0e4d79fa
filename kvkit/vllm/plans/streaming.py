"""``streaming`` (StreamingLLM): every layer's decode rows read the sink blocks and the most recent blocks.

A decode row of more than ``budget_blocks`` blocks reads blocks ``[0, sink_blocks)`` and its last ``recent_blocks``
(``budget_blocks = max(ceil(budget / block_size), sink_blocks + 1)``, ``sink_blocks = ceil(sink / block_size)``): one
reduced table per step (:mod:`kvkit.vllm.reads`), built in the metadata builder and read by every layer. With
``free=1`` the KV-cache spec is :class:`kvkit.vllm.spec.KvkitStreamingSpec`, whose block manager frees the blocks
between the sinks and the recent window once the prompt is processed (constant KV per decoding request); ``free=0``
holds every block and only skips reading them (then the benchmark switch can read them all again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvkit.vllm import reads
from kvkit.vllm.plans import register
from kvkit.vllm.plans.base import Plan, require_int, set_default


@register("streaming")
@dataclass(frozen=True)
class StreamingPlan(reads.BlockBudget, Plan):
    """budget : tokens read (and, with ``free=1``, held) per decoded token; rounded up to whole blocks.
    sink : leading tokens always read (None: 4; rounded up to whole blocks; 0: none).
    free : free the middle blocks during decoding (1) or only skip reading them (0). Plugin-only."""

    budget: int = 1024
    sink: int | None = None
    free: int = 1

    plugin_options = ("free",)

    def check(self) -> None:
        set_default(self, "sink", reads.SINK_DEFAULT)
        require_int(self, "budget", "sink", "free")
        if self.budget < 1:
            raise ValueError(f"kvkit.vllm: budget must be >= 1, got {self.budget}")
        if self.sink >= self.budget:
            raise ValueError(f"kvkit.vllm: streaming sink ({self.sink}) must be smaller than budget ({self.budget})")
        if self.free not in (0, 1):
            raise ValueError(f"kvkit.vllm: free must be 0 or 1, got {self.free!r}")

    def hf_options(self) -> dict:
        return dict(budget=self.budget, sink=self.sink)

    def customize_spec(self, spec):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        if not self.free or type(spec) is not FullAttentionSpec:
            return spec
        from kvkit.vllm.spec import KvkitStreamingSpec

        bs = spec.block_size
        return KvkitStreamingSpec.from_spec(spec, self.sink_blocks(bs), self.recent_blocks(bs))

    def plan_step(self, builder, md, num_reqs: int, force_full: bool) -> reads.StepReads:
        bs = builder.block_size
        rows = reads.decode_rows(md, num_reqs, bs)
        step = reads.new_step(rows, bs)
        if force_full and not self.free:  # freed blocks cannot be read back: free=1 ignores the switch
            return step
        if reads.reduce_rows(builder, md, rows, step, self.budget_blocks(bs)):
            s, r = self.sink_blocks(bs), self.recent_blocks(bs)
            n = step.rows.numel()
            cols = torch.cat([torch.arange(s).expand(n, s), (step.nb - r).unsqueeze(1) + torch.arange(r)], dim=1)
            step.reduced = reads.with_table(md, step, step.rows, cols)
        return step

    def forward(self, impl, state, step, layer, query, key, value, kv_cache, md, output, output_scale=None,
                output_block_scale=None):
        reads.begin_layer(step, kv_cache)
        read_md = step.reduced if step.rows is not None else md
        return reads.read(impl, step, read_md, layer, query, key, value, kv_cache, md, output, output_scale,
                          output_block_scale)
