"""``snapkv``: SnapKV (Li et al., arXiv:2404.14469) -- keep what the observation window attends to.

After the exact prefill, the last ``window`` prompt queries (the observation window) attend to the prompt
(:func:`~kvkit.stores.scored.window_attention`); a token's score is the attention they pay it, summed over the
window, avg-pooled along the keys (``kernel``) and averaged over each KV head's query group; per KV head the
``budget - window - sink`` best tokens are kept besides the window itself (and ``sink`` first tokens, 0 in the
paper). With the question at the end of the prompt the window is the question (the paper's setting).
Decoding (kvkit's extension, the paper compresses the prompt only): new tokens are appended and, every ``tail``
tokens above the budget, the same scoring with the last ``window`` decode queries evicts again, so memory stays
at most ``budget + tail`` slots per KV head. All of it is a :class:`~kvkit.stores.scored.ScoredStore`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvkit.policies.base import Policy, check_positive_int
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.scored import ScoredStore, pool_group, window_attention


@register("snapkv")
@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV observation-window eviction, per KV head.

    Parameters
    ----------
    budget : int
        Slots kept per KV head, window included (the reference's ``max_capacity_prompt``).
    window : int
        Observation window: the last prompt queries that score, their tokens always kept (reference: 64).
    kernel : int
        Pooling kernel along the keys (reference: 5, average pooling).
    sink : int
        First tokens always kept (0 in the paper; kvkit option).
    tail : int
        Decode tokens allowed above the budget before a bulk eviction (kvkit).
    """

    budget: int = 1024  # SnapKV max_capacity_prompt (paper sweeps 1024-4096)
    window: int = 64  # SnapKV reference window_size
    kernel: int = 5  # SnapKV reference kernel_size (avgpool)
    sink: int = 0  # not in the paper
    tail: int = 32  # kvkit: bulk decode eviction

    description = "SnapKV: observation-window attention, pooled, per-head top-k of the prompt (2404.14469)"
    saves = "memory+reads"
    test_options: ClassVar[dict] = dict(budget=16, window=4, kernel=3, tail=4)
    covering_options: ClassVar[dict | None] = dict(budget=4096)

    def __post_init__(self):
        for name in ("budget", "window", "kernel", "tail"):
            check_positive_int("snapkv", name, getattr(self, name))
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"snapkv: sink must be an integer >= 0, got {self.sink!r}")
        if self.window + self.sink >= self.budget:
            raise ValueError(f"snapkv: budget ({self.budget}) must exceed window + sink ({self.window + self.sink})")
        if self.kernel % 2 == 0:
            raise ValueError(f"snapkv: kernel must be odd (padding kernel // 2 keeps the length), got {self.kernel}")

    def new_layer(self, info: LayerInfo):
        return SnapKVStore(info, self)


class SnapKVStore(ScoredStore):
    def __init__(self, info: LayerInfo, p: SnapKV):
        super().__init__(info, p.budget, p.sink, p.window, p.tail, observe=p.window)
        self.kernel = p.kernel

    def score(self):
        q, qpos = self.observed()
        a = window_attention(q, self.keys, self.pos, qpos, self.scaling).sum(dim=2)  # [B, Hq, n]
        return pool_group(a, self.kernel, self.keys.shape[1])  # [B, H, n]
