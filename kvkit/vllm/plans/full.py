"""``full``: the plugin's backend with nothing changed: every decode row reads every block (vLLM's own tables),
counted per step in ``kvkit.vllm.stats.STATS`` (the reference for the other plans' read fractions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvkit.vllm import reads
from kvkit.vllm.plans import register
from kvkit.vllm.plans.base import Plan


@register("full")
@dataclass(frozen=True)
class FullPlan(Plan):
    """Full attention (``kvkit.policies.full.Full``); no options. Runs on sliding-window models too."""

    sliding_window_ok: ClassVar[bool] = True

    def hf_options(self) -> dict:
        return {}

    def plan_step(self, builder, md, num_reqs: int, force_full: bool) -> reads.StepReads:
        return reads.new_step(reads.decode_rows(md, num_reqs, builder.block_size), builder.block_size)

    def forward(self, impl, state, step, layer, query, key, value, kv_cache, md, output, output_scale=None,
                output_block_scale=None):
        reads.begin_layer(step, kv_cache)
        return reads.read(impl, step, md, layer, query, key, value, kv_cache, md, output, output_scale,
                          output_block_scale)
