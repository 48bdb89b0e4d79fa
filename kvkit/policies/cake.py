"""``cake``: CAKE, cascading and adaptive KV cache eviction (Qin et al., arXiv:2503.12491).

Prefill of layer ``m`` is exact attention over the prompt; then, from the last ``window`` prompt
queries only (``A = softmax(q_window K^T)`` in fp32, causal inside the window, ``[B, Hq, w, S]`` --
never the full ``S x S`` matrix):

* **layer preference** ``P_m = H^(1/tau1) * V^(1/tau2)`` with the entropy ``H = -sum A log(A + 1e-10)``
  and ``V`` = the variance across window queries summed over heads and keys, both on the non-window
  keys;
* **eviction indicator** per key: mean over window queries of ``A`` + ``gamma`` x their variance,
  avg-pooled along the keys (kernel 5 in the paper, centered; per model, see ``pool_kernel``; kvkit's
  ``pool_window="trailing"`` pools a key with the ``kernel - 1`` keys before it instead), averaged over the
  query heads of each KV group;
  the window's own keys always stay;
* **cascading allocation**: the total evictable budget ``B = (budget - window) * L`` is shared among
  the layers ``l <= m`` whose prefill has run, ``P_l / sum_{k<=m} P_k`` each (integers, capped at the
  prompt's non-window length, the excess and the rounding remainder spread equally over the uncapped
  layers, as the reference's ``adjust_budgets``), and every layer ``l <= m`` is re-evicted to its new
  budget by top-k per KV head on its stored indicator. Evicted tokens are gone, so a layer's budget
  only shrinks (``min`` with its previous budget) and the KV held after layer ``m`` never exceeds
  ``B + (m + 1) * window``. Nothing is evicted from a prompt of at most ``budget + window`` tokens.

Decode: each layer keeps ``prefill budget + window`` live tokens (``max(prompt, budget)`` for prompts
that were not evicted). New tokens are appended uncompressed; once ``tail`` extra tokens have arrived
the layer evicts in bulk at the start of ``update``: the last ``tail`` decode queries' softmax over the
held tokens (mean over those queries, pooled, group-averaged, as the reference scores with the current
query) ranks the non-window tokens and the top ones are kept; the last ``window`` tokens always stay.
The buffered decode queries (at most ``tail + 64``) are cropped with the tokens, so ``crop`` is exact.

Batches: every row gets its own preference, allocation and decode trigger, exactly as if it ran
alone; rows are kept rectangular by *dead* slots (position -1, never read) placed before a row's live
slots, so pooling sees the same zeros a lone row sees at its left edge. ``nbytes`` counts the dead
slots too (they are held).

Per-model ``tau1``/``tau2`` (the paper's values at cache size 1024) are chosen by the model's name or
shape; other models, including the bundled SmolLM2-135M, get (1.0, 1.0) (the reference's value for
unknown models). Options ``tau1``/``tau2`` override.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvkit.calibration import resolve
from kvkit.policies.base import Policy, check_choice, check_odd_kernel, check_positive_int
from kvkit.policies.cake_store import (  # noqa: F401  (re-exported: kvkit.policies.cake.<name> as before)
    EPS,
    QUERY_SLACK,
    CakeCascade,
    CakeStore,
    allocate,
    cascade_history,
)
from kvkit.policies.knobs import budget_for, build_slot_cost, protected_share, static_prompt
from kvkit.policies.protect_heads import ProtectHeads, check_protect, split_or_plain
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.scored import POOL_WINDOWS
from kvkit.stores.static import static_store

#: CAKE's tau1/tau2 at cache size 1024 (paper / reference config): name fragment -> (tau1, tau2)
TAU_TABLE = {
    "llama-3.1-8b": (1.6, 0.4),
    "mistral-7b-v0.3": (0.8, 0.5),
    "qwen2.5-7b": (1.5, 0.6),
    "llama-2-7b": (1.9, 1.8),
}
DEFAULT_TAU = (1.0, 1.0)  # CAKE reference: unknown models
#: (model_type, layers, hidden, kv_heads, vocab) of each table entry, for models loaded under another name
_SHAPES = {
    ("llama", 32, 4096, 8, 128256): "llama-3.1-8b",
    ("mistral", 32, 4096, 8, 32768): "mistral-7b-v0.3",
    ("qwen2", 28, 3584, 4, 152064): "qwen2.5-7b",
    ("llama", 32, 4096, 32, 32000): "llama-2-7b",
}


def model_taus(config) -> tuple[tuple[float, float], str]:
    """CAKE's (tau1, tau2) for a model config and where it came from (a table entry or "default")."""
    name = str(getattr(config, "_name_or_path", "") or "").lower().replace("_", "-")
    for key, taus in TAU_TABLE.items():
        if key in name:
            return taus, key
    shape = (
        getattr(config, "model_type", None), getattr(config, "num_hidden_layers", None),
        getattr(config, "hidden_size", None),
        getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None),
        getattr(config, "vocab_size", None),
    )
    key = _SHAPES.get(shape)
    if key == "llama-3.1-8b":  # Llama-3-8B has the same shape; 3.1 is told apart by its llama3 RoPE scaling
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if not (isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "llama3"):
            key = None
    return (TAU_TABLE[key], key) if key else (DEFAULT_TAU, "default")


@register("cake")
@dataclass(frozen=True)
class Cake(ProtectHeads, Policy):
    """CAKE: per-layer budgets from attention entropy/variance, cascading eviction during prefill.

    Parameters
    ----------
    budget : int
        Average tokens kept per layer *including* the window (the paper's cache_size); 1024 default.
    window : int
        Last prompt queries used for scoring, their tokens always kept (S_w = 32 in the paper).
    gamma : float
        Weight of the variance in the eviction indicator (200 in the paper).
    pool_kernel : int or None
        Average-pooling kernel of the indicator along the keys (5 in the paper; padding kernel // 2). None: the
        model's calibrated kernel (``kvkit calibrate cake``, question-aware: with one token per digit a 7-digit
        value outgrows the paper's kernel), else 5.
    pool_window : str or None
        ``"centered"`` (the paper: ``kernel // 2`` tokens on each side) or ``"trailing"`` (kvkit: the token and
        the ``kernel - 1`` before it, so the tokens after an attended one inherit its score). None: calibrated,
        else centered.
    tau1, tau2 : float or None
        Temperatures of the layer preference ``H^(1/tau1) * V^(1/tau2)``; None: the paper's per-model
        values (``TAU_TABLE``), (1.0, 1.0) for other models.
    tail : int or None
        Decode tokens allowed above a layer's size before a bulk eviction (kvkit; at most ``window``);
        None: ``window``.
    calibrated : bool
        True (default): with tau1/tau2/pool_kernel left at None, the model's calibrated taus and kernel
        (``kvkit calibrate cake``; found from the config by :mod:`kvkit.calibration`) before the paper's
        table and kernel 5. False: the paper's table / (1.0, 1.0) and kernel 5.
    protect_heads : float or None
        Fraction of the KV heads kept whole, the ones the model's DuoAttention pattern ranks highest (kvkit,
        :mod:`kvkit.policies.protect_heads`); ``budget`` is then per evicted head: the cascade shares ``budget x
        evicted heads`` head-slots among the layers by preference, and a layer's preference is computed over its
        evicted heads. None (default), where a pattern ships for the model: with ``compression_ratio`` 0.7 at 0.25,
        0.3 at 0.5, 0.1 at 0.75, linear between them (:attr:`protect_knots`: measured on fresh needles; the other
        eviction policies take 0.4 at 0.5, the share that leaves each evicted head a sixth of the context, but CAKE's
        cascade gives some layers less than the mean and keeps more needles with 0.3), outside them the sixth-of-the-
        context rule (:func:`~kvkit.policies.protect_heads.default_protect`); with a ``budget`` 0.2; else 0 (warned
        once). 0: the paper.
    protect_pattern : str, path, values or None
        The pattern ``protect_heads`` ranks by (as duo's ``pattern``); None: the one shipped for the model.
    """

    budget: int = 1024  # CAKE cache_size (per-layer average, window included)
    window: int = 32  # CAKE S_w
    gamma: float = 200.0  # CAKE gamma
    pool_kernel: int | None = None  # None: calibrated, else CAKE's avg-pool kernel size 5
    pool_window: str | None = None  # None: calibrated, else CAKE's centered window (kvkit: "trailing")
    tau1: float | None = None  # CAKE Table: per-model; None = by model, (1.0, 1.0) if unknown
    tau2: float | None = None  # CAKE Table: per-model; None = by model, (1.0, 1.0) if unknown
    tail: int | None = None  # kvkit: bulk decode eviction every `tail` tokens; None = window
    calibrated: bool = True  # kvkit: the model's calibrated taus when none given; False = the paper's table
    protect_heads: float | None = None  # kvkit: protect_knots / default_protect(ratio) if a pattern ships (0 = paper)
    protect_pattern: object = None  # kvkit: the pattern `protect_heads` ranks by; None = the model's shipped one

    static_capable: ClassVar[bool] = True
    description = "CAKE: layer budgets from attention entropy+variance, cascading eviction, mean+var indicator (2503.12491)"
    saves = "memory+reads"
    calibrated_options: ClassVar[tuple[str, ...]] = ("tau1", "tau2", "pool_kernel", "pool_window")
    ratio_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    # kvkit: the default protected share at 0.25 / 0.5 / 0.75 (results/needles/README.md, "The protected share")
    protect_knots: ClassVar[tuple[tuple[float, float], ...]] = ((0.25, 0.7), (0.5, 0.3), (0.75, 0.1))
    paper: ClassVar[dict] = dict(calibrated=False, protect_heads=0.0)
    covering_options: ClassVar[dict | None] = dict(budget=4096)
    speculative_refusal: ClassVar[str | None] = (
        "CAKE evicts in bulk when its tail fills, ranking tokens by the attention of the buffered decode "
        "queries; a speculative round feeds gamma + 1 tokens at once and must keep them croppable, so the "
        "eviction runs at another token count and sees other queries than in one-token decoding"
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("budget", "window"):
            check_positive_int("cake", name, getattr(self, name))
        check_odd_kernel("cake", "pool_kernel", self.pool_kernel)
        check_positive_int("cake", "tail", self.tail, allow_none=True)
        if self.budget <= self.window:
            raise ValueError(
                f"cake: budget ({self.budget}) must be larger than window ({self.window}): budget is the average "
                "cache size per layer including the window"
            )
        check_choice("cake", "pool_window", self.pool_window, POOL_WINDOWS)
        if self.tail is not None and self.tail > self.window:
            raise ValueError(
                f"cake: tail ({self.tail}) must be at most window ({self.window}) so every scored token was seen by "
                "all the decode queries that score it"
            )
        for name in ("gamma", "tau1", "tau2"):
            v = getattr(self, name)
            if v is None and name != "gamma":
                continue
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
            if not ok or v < 0 or (name != "gamma" and v == 0):
                raise ValueError(f"cake: {name} must be a {'non-negative' if name == 'gamma' else 'positive'} number, got {v!r}")
        check_protect(self)

    def taus(self, config) -> tuple[float, float]:
        (t1, t2), _ = model_taus(config) if config is not None else (DEFAULT_TAU, "default")
        return (self.tau1 if self.tau1 is not None else t1, self.tau2 if self.tau2 is not None else t2)

    def shared_state(self, mask):
        return CakeCascade(protected=mask)

    def new_layer(self, info: LayerInfo):
        prompt = static_prompt(self, info)  # a static store: the budget for the declared prompt, now
        p = resolve(self, info.config)
        cls = static_store(CakeStore) if info.static else CakeStore
        taus = p.taus(info.config)
        at = None
        if self.compression_ratio is not None:  # the mean kept per layer (window included) from the context length
            share = protected_share(info.shared.protected, info.config)
            at = lambda S, cost: budget_for(self.name, self.compression_ratio, S, share,  # noqa: E731
                                            floor=self.window + 1, cost=cost)

        def store(n):
            s = cls(info, p, *taus, num_heads=n, budget_at=at)
            if prompt is not None:
                s.budget = at(prompt, build_slot_cost(info))
            return s

        return split_or_plain(info, store, info.shared.protected)
