"""``streaming``: StreamingLLM (Xiao et al., arXiv:2309.17453) -- attention sinks + a recent window.

Each layer keeps the first ``sink`` tokens of every sequence plus the most recent
``budget - sink`` tokens; the middle is evicted for real. A query at position p reads exactly the
sinks and the window of positions ``(p - window, p]``, whatever the eviction timing: evicted tokens
are removed in bulk once ``tail`` extra tokens have accumulated, so a layer holds at most
``budget + tail`` tokens, and ``crop`` (speculative rollback) stays exact.

Rollback (transformers' assisted decoding with a streaming-patched assistant): what a query reads
depends only on positions, not on when eviction ran, so the store may compress at any time as long
as every crop leaves the window of the next query held. After a compression at length ``s`` the
store holds positions ``[s - window, s)``; a query at ``s - 1`` reads ``[s - window, s - 1]``, so
``crop`` may go back one token below the compression point (HF re-feeds the last prompt token after
the assistant's prefill). And the first ``update`` after a ``crop`` (the start of a speculative
round) compresses early whenever more than ``budget`` tokens are held, so a round that adds fewer
than ``tail`` tokens never compresses in its middle and its rollback is always exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvkit.policies.base import Policy, check_positive_int
from kvkit.policies.knobs import budget_for, build_slot_cost, slot_cost, static_prompt
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.scored import ScoredStore
from kvkit.stores.static import static_store


@register("streaming")
@dataclass(frozen=True)
class Streaming(Policy):
    """StreamingLLM sinks + recent window.

    Parameters
    ----------
    budget : int
        Tokens kept per layer (sinks + window); 1024 as in the paper's default cache.
    sink : int
        Attention-sink tokens kept from the start of each sequence (4 in the paper).
    tail : int
        Uncompressed tokens allowed above the budget before a bulk eviction (kvkit, not the paper).
    """

    budget: int = 1024  # StreamingLLM default cache size
    sink: int = 4  # StreamingLLM: 4 initial tokens
    tail: int = 32  # kvkit: bulk eviction every 32 tokens keeps crop() exact at a small memory overhead

    static_capable: ClassVar[bool] = True
    description = "StreamingLLM: sink tokens + recent window, middle evicted (2309.17453)"
    saves = "memory+reads"
    ratio_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    covering_options: ClassVar[dict | None] = dict(budget=4096)

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("streaming", "budget", self.budget)
        check_positive_int("streaming", "tail", self.tail)
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"streaming: sink must be an integer >= 0, got {self.sink!r}")
        if self.sink >= self.budget:
            raise ValueError(
                f"streaming: sink ({self.sink}) must be smaller than budget ({self.budget}) so the recent "
                "window keeps at least one token"
            )

    def new_layer(self, info: LayerInfo):
        prompt = static_prompt(self, info)  # a static store: the budget for the declared prompt, now
        cls = static_store(StreamingStore) if info.static else StreamingStore
        store = cls(info, self.budget, self.sink, self.tail)
        if self.compression_ratio is not None:
            store.budget_at = lambda S, cost: budget_for(self.name, self.compression_ratio, S, floor=self.sink + 1,
                                                         cost=cost)
        if prompt is not None:
            store.set_budget(store.budget_at(prompt, build_slot_cost(info, heads_sharing=info.num_kv_heads)))
        return store


class StreamingStore(ScoredStore):
    """Sinks + recent window (a :class:`ScoredStore` whose protected set is the whole budget); all KV heads hold
    the same positions. Each query reads exactly its sinks and the ``window`` positions before it."""

    def __init__(self, info: LayerInfo, budget: int, sink: int, tail: int, num_heads: int | None = None):
        super().__init__(info, budget, sink, budget - sink, tail, num_heads=num_heads)
        self.rolled_back = False  # a rollback ended a speculative round: compress early at the next update
        self.budget_at = None  # compression_ratio: ``context -> budget`` at each prefill

    def on_prefill(self, query, module) -> None:
        if self.budget_at is not None:
            self.set_budget(self.budget_at(self.seen, slot_cost(self.keys, heads_sharing=self.keys.shape[1])))
        super().on_prefill(query, module)

    def set_budget(self, budget: int) -> None:
        """Keep ``budget`` slots: the sinks and a recent window of ``budget - sink``."""
        self.budget, self.window = budget, budget - self.sink

    def should_compress(self) -> bool:
        held = self.keys.shape[-2]
        return held >= self.budget + self.tail or (self.rolled_back and held > self.budget)

    def compress_if_due(self) -> None:
        super().compress_if_due()
        self.rolled_back = False

    def on_round_end(self) -> None:
        self.rolled_back = True  # also on crop(0): every rollback call ends a round

    def crop_floor(self) -> int:
        # held after a compression at length `committed`: positions >= committed - window (+ sinks);
        # the next query after a crop to c reads (c - window, c], all held iff c >= committed - 1
        return max(self.committed - 1, 0)

    def reset(self) -> None:
        super().reset()
        self.rolled_back = False

    def visible(self, qpos: torch.Tensor) -> torch.Tensor:
        # int64: qpos - window cannot overflow; no host int, so a compiled step reads it as well
        recent = self.pos[:, :, None, :].long() > (qpos.view(1, 1, -1, 1).long() - self.window)
        return recent | self.sinks()[:, :, None, :]
