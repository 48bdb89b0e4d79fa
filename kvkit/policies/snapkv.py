"""``snapkv``: SnapKV (Li et al., arXiv:2404.14469) -- keep what the observation window attends to.

After the exact prefill, the last ``window`` prompt queries (the observation window) attend to the prompt
(:func:`~kvkit.stores.scored.window_attention`); a token's score is the attention they pay it, summed over the
window, pooled along the keys (``kernel``; average pooling, the reference's default, or max pooling, its other
option) and averaged over each KV head's query group; per KV head the ``budget - window - sink`` best tokens are
kept besides the window itself (and ``sink`` first tokens, 0 in the paper). With the question at the end of the
prompt the window is the question (the paper's setting).

The pooling kernel is per model (kvkit, ``kvkit calibrate snapkv``): the window's queries attend to the *start*
of the answer (the first digit of a number), and pooling is what keeps the tokens after it. The paper's kernel 5
covers a number Llama-3 writes in 3 tokens; tokenizers that write one token per digit (SmolLM2, Qwen2.5) need a
wider one. kvkit adds a ``trailing`` pooling window (``pool_window``): a token pools its own score with the
``kernel - 1`` tokens *before* it, so the whole value after the key the window attends to inherits the key's
score, where the reference's centered window spends half its reach on tokens before the key (a long value's
last tokens can be lost; the two windows compared: results/ruler/README.md). With ``kernel``, ``pooling``
and ``pool_window`` left at None the model's calibrated values apply (:mod:`kvkit.calibration`), else the
paper's (5, avg, centered); ``calibrated=False`` always gives the paper's.
Decoding (kvkit's extension, the paper compresses the prompt only): new tokens are appended and, every ``tail``
tokens above the budget, the same scoring with the last ``window`` decode queries evicts again, so memory stays
at most ``budget + tail`` slots per KV head. All of it is a :class:`~kvkit.stores.scored.ScoredStore`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvkit.calibration import resolve
from kvkit.policies.base import Policy, check_choice, check_odd_kernel, check_positive_int
from kvkit.policies.knobs import budget_for, build_slot_cost, protected_share, slot_cost, static_prompt
from kvkit.policies.protect_heads import ProtectHeads, check_protect, split_or_plain
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.scored import POOL_WINDOWS, ScoredStore, pool_group, window_attention
from kvkit.stores.static import static_store


@register("snapkv")
@dataclass(frozen=True)
class SnapKV(ProtectHeads, Policy):
    """SnapKV observation-window eviction, per KV head.

    Parameters
    ----------
    budget : int
        Slots kept per KV head, window included (the reference's ``max_capacity_prompt``).
    window : int
        Observation window: the last prompt queries that score, their tokens always kept (reference: 64).
    kernel : int or None
        Pooling kernel along the keys, odd (reference: 5). None: the model's calibrated kernel, else 5.
    pooling : str or None
        ``"avg"`` (reference default) or ``"max"`` (the reference's other option). None: calibrated, else avg.
    pool_window : str or None
        ``"centered"`` (the reference: ``kernel // 2`` tokens on each side) or ``"trailing"`` (kvkit: a token's
        window is itself and the ``kernel - 1`` tokens before it, so a whole answer after the token the window
        attends to inherits its score). None: calibrated, else centered.
    sink : int
        First tokens always kept (0 in the paper; kvkit option).
    tail : int
        Decode tokens allowed above the budget before a bulk eviction (kvkit).
    calibrated : bool
        True (default): ``kernel`` / ``pooling`` / ``pool_window`` left at None take the model's calibration when
        one is found from its config. False: the paper's kernel 5, average pooling, centered.
    protect_heads : float or None
        Fraction of the KV heads kept whole, the ones the model's DuoAttention pattern ranks highest (kvkit,
        :mod:`kvkit.policies.protect_heads`); ``budget`` is then per evicted head. None (default), where a pattern
        ships for the model: with ``compression_ratio`` the share that leaves each evicted head a sixth of the
        context (0.4 at 0.5, 0.1 at 0.75; :func:`~kvkit.policies.protect_heads.default_protect`), with a ``budget``
        0.2; else 0 (warned once). 0: the paper, every head evicted.
    protect_pattern : str, path, values or None
        The pattern ``protect_heads`` ranks by (as duo's ``pattern``); None: the one shipped for the model.
    """

    budget: int = 1024  # SnapKV max_capacity_prompt (paper sweeps 1024-4096)
    window: int = 64  # SnapKV reference window_size
    kernel: int | None = None  # None: calibrated, else the SnapKV reference's kernel_size 5
    pooling: str | None = None  # None: calibrated, else the reference's avgpool
    pool_window: str | None = None  # None: calibrated, else the reference's centered window (kvkit: "trailing")
    sink: int = 0  # not in the paper
    tail: int = 32  # kvkit: bulk decode eviction
    calibrated: bool = True  # kvkit: the model's calibrated kernel / pooling; False = the paper's (5, avg)
    protect_heads: float | None = None  # kvkit: default_protect(ratio) if a pattern ships (0 = paper)
    protect_pattern: object = None  # kvkit: the pattern `protect_heads` ranks by; None = the model's shipped one

    static_capable: ClassVar[bool] = True
    description = "SnapKV: observation-window attention, pooled, per-head top-k of the prompt (2404.14469)"
    saves = "memory+reads"
    calibrated_options: ClassVar[tuple[str, ...]] = ("kernel", "pooling", "pool_window")
    ratio_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    paper: ClassVar[dict] = dict(calibrated=False, protect_heads=0.0)
    covering_options: ClassVar[dict | None] = dict(budget=4096)
    speculative_refusal: ClassVar[str | None] = (
        "SnapKV evicts in bulk when its tail fills, ranking tokens by the attention of its observation-window "
        "queries; a speculative round feeds several tokens at once and must keep them croppable, so the eviction "
        "runs at another token count and sees other queries than in one-token decoding"
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("budget", "window", "tail"):
            check_positive_int("snapkv", name, getattr(self, name))
        check_odd_kernel("snapkv", "kernel", self.kernel)
        if self.pooling is not None and self.pooling not in ("avg", "max"):
            raise ValueError(f"snapkv: pooling must be 'avg' or 'max' (the reference's avgpool / maxpool), got "
                             f"{self.pooling!r}")
        check_choice("snapkv", "pool_window", self.pool_window, POOL_WINDOWS)
        if not isinstance(self.calibrated, bool):
            raise ValueError(f"snapkv: calibrated must be true or false, got {self.calibrated!r}")
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"snapkv: sink must be an integer >= 0, got {self.sink!r}")
        if self.window + self.sink >= self.budget:
            raise ValueError(f"snapkv: budget ({self.budget}) must exceed window + sink ({self.window + self.sink})")
        check_protect(self)

    def settings(self, config) -> tuple[int, str, str]:
        """``(kernel, pooling, pool_window)`` for a model: the options given, else its calibration, else the
        paper's (5, avg, centered)."""

        p = resolve(self, config)
        return (p.kernel if p.kernel is not None else 5), (p.pooling or "avg"), (p.pool_window or "centered")

    def budget_at(self, info: LayerInfo):
        """``context -> budget`` per evicted head for ``compression_ratio`` (None without it)."""
        if self.compression_ratio is None:
            return None
        share = protected_share(info.shared, info.config)
        return lambda S, cost: budget_for(self.name, self.compression_ratio, S, share,
                                          floor=self.window + self.sink + 1, cost=cost)

    def new_layer(self, info: LayerInfo):
        prompt = static_prompt(self, info)  # a static store: the budget for the declared prompt, now
        cls = static_store(SnapKVStore) if info.static else SnapKVStore
        settings = self.settings(info.config)
        at = self.budget_at(info)

        def store(n):
            s = cls(info, self, *settings, num_heads=n, budget_at=at)
            if prompt is not None:
                s.budget = at(prompt, build_slot_cost(info))
            return s

        return split_or_plain(info, store, info.shared)


class SnapKVStore(ScoredStore):
    def __init__(self, info: LayerInfo, p: SnapKV, kernel: int, pooling: str, pool_window: str = "centered",
                 num_heads: int | None = None, budget_at=None):
        super().__init__(info, p.budget, p.sink, p.window, p.tail, observe=p.window, num_heads=num_heads)
        self.kernel, self.pooling, self.pool_window = kernel, pooling, pool_window
        self.budget_at = budget_at  # compression_ratio: the budget from the context length at each prefill

    def on_prefill(self, query, module) -> None:
        if self.budget_at is not None:
            self.budget = self.budget_at(self.seen, slot_cost(self.keys))
        super().on_prefill(query, module)

    def score(self):
        q, qpos = self.observed()
        a = window_attention(q, self.keys, self.pos, qpos, self.scaling).sum(dim=2)  # [B, Hq, n]
        return pool_group(a, self.kernel, self.keys.shape[1], mode=self.pooling, window=self.pool_window)  # [B, H, n]
