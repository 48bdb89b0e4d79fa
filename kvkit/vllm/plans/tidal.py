"""``tidal`` (TidalDecode, position persistence): selection layers pick the blocks the following layers read.

Layers 0, 1 and the selection layers (2 and ``reselect_layer``, default ``round(0.4 L)``) read every block; after
its own read a selection layer scores each block of each long decode row (:class:`kvkit.vllm.selection.
BlockSelection`: ``score=exact`` from a copy of the selection layers' keys, ``score=quest`` from per-block key
max / min) and keeps the sink blocks, the last block and the top-k others, ``budget_blocks`` in all. The layers after
it read that reduced table until the next selection layer. All blocks stay held.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvkit.vllm import reads
from kvkit.vllm.plans import register
from kvkit.vllm.plans.base import Plan, require_int, set_default
from kvkit.vllm.selection import BlockSelection


@register("tidal")
@dataclass(frozen=True)
class TidalPlan(BlockSelection, Plan):
    """budget : tokens read per decoded token at the layers that read a selection; rounded up to whole blocks.
    sink : leading tokens always read (None: 4; rounded up to whole blocks). Plugin-only.
    reselect_layer : the re-selection layer (None: round(0.4 * num_layers), TidalDecode).
    score : how a selection layer scores blocks: "exact" (TidalDecode: softmax of q.k over every token, max over a
        block's tokens and over heads) or "quest" (Quest's upper bound from per-block key min/max: no key copy,
        coarser). Plugin-only.

    The transformers policy is built with ``calibrated=False``: the plugin runs TidalDecode's layout, no per-model
    calibration of the selection layers."""

    budget: int = 1024
    sink: int | None = None
    reselect_layer: int | None = None
    score: str = "exact"

    plugin_options = ("sink", "score")

    def check(self) -> None:
        set_default(self, "sink", reads.SINK_DEFAULT)
        require_int(self, "budget", "sink")
        if self.budget < 1:
            raise ValueError(f"kvkit.vllm: budget must be >= 1, got {self.budget}")
        if self.score not in ("exact", "quest"):
            raise ValueError(f"kvkit.vllm: score must be 'exact' or 'quest', got {self.score!r}")
        r = self.reselect_layer
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 3):
            raise ValueError(f"kvkit.vllm: reselect_layer must be an integer >= 3, got {r!r}")

    def hf_options(self) -> dict:
        return dict(budget=self.budget, reselect_layer=self.reselect_layer, calibrated=False)

    @property
    def summary_score(self) -> str:
        return self.score

    def select_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers that read everything and (re)select the blocks the next layers read: 2, then
        ``reselect_layer`` (default ``round(0.4 * num_layers)`` from 5 layers on); () below 3 layers."""
        r = self.reselect_layer
        if r is not None and not 2 < r < num_layers:
            # the selection would silently run without it (and without the default one): refuse instead
            raise ValueError(
                f"kvkit.vllm: tidal reselect_layer must be in [3, {num_layers - 1}] for a model with {num_layers} "
                f"layers (layer 2 is the first selection layer); got {r}"
            )
        if num_layers < 3:
            return ()
        layers = [2]
        if r is None and num_layers >= 5:
            r = round(0.4 * num_layers)
        if r is not None and 2 < r < num_layers:
            layers.append(r)
        return tuple(layers)

    def forward(self, impl, state, step, layer, query, key, value, kv_cache, md, output, output_scale=None,
                output_block_scale=None):
        reads.begin_layer(step, kv_cache)
        li = impl.kvkit_layer(layer)
        read_md = md
        sel = step.select_layers
        if step.rows is not None and li not in sel and step.reduced is not None and li > sel[0]:
            read_md = step.reduced
        out = reads.read(impl, step, read_md, layer, query, key, value, kv_cache, md, output, output_scale,
                         output_block_scale)
        if step.rows is not None and li in sel:
            step.reduced = self.select(impl, state, step, query, md)
        return out
