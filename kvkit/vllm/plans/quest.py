"""``quest`` (Quest, arXiv:2406.10774, at block granularity): every layer from 2 on picks its own blocks.

Layers 0-1 read every block; every later layer scores each block of each long decode row from its own query and
per-block key max / min (Quest's upper bound, :class:`kvkit.vllm.selection.BlockSelection`) before reading, and reads
the sink blocks, the last block and the top-k others, ``budget_blocks`` in all. All blocks stay held; the summaries
cost ``2 x D x 4`` bytes per block, KV head and layer. Plugin-only (no transformers policy of this name).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvkit.vllm import reads
from kvkit.vllm.plans import register
from kvkit.vllm.plans.base import Plan, require_int, set_default
from kvkit.vllm.selection import BlockSelection


@register("quest")
@dataclass(frozen=True)
class QuestPlan(BlockSelection, Plan):
    """budget : tokens read per decoded token by each selecting layer; rounded up to whole blocks.
    sink : leading tokens always read (None: 4; rounded up to whole blocks)."""

    budget: int = 1024
    sink: int | None = None

    plugin_options = ("budget", "sink")
    summary_score = "quest"

    def check(self) -> None:
        set_default(self, "sink", reads.SINK_DEFAULT)
        require_int(self, "budget", "sink")
        if self.budget < 1:
            raise ValueError(f"kvkit.vllm: budget must be >= 1, got {self.budget}")

    def select_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers that select and read only what they selected: 2 to the last (() below 3 layers)."""
        return tuple(range(2, num_layers)) if num_layers >= 3 else ()

    def forward(self, impl, state, step, layer, query, key, value, kv_cache, md, output, output_scale=None,
                output_block_scale=None):
        reads.begin_layer(step, kv_cache)
        read_md = md
        if step.rows is not None and impl.kvkit_layer(layer) in step.select_layers:
            read_md = self.select(impl, state, step, query, md) or md  # its own selection, then read it
        return reads.read(impl, step, read_md, layer, query, key, value, kv_cache, md, output, output_scale,
                          output_block_scale)
