"""``protect_heads``: the eviction policies' protected heads -- the KV heads a DuoAttention pattern ranks as retrieval
heads keep every token; the policy evicts only in the others (kvkit, after RazorAttention / HeadKV).

Why (results/needles/README.md): question-agnostic, an eviction policy scores the context
without the question, and on the default model the heads that read a needle's value when the question comes (two
heads, attention on the value up to 0.99) rank those tokens low under every question-agnostic score tried (the
context's last queries, its reconstruction): per-head eviction removes the value from exactly the heads that
answer. DuoAttention's calibrated gate (alpha per KV head, ``kvkit calibrate duo``) names the heads that need the
whole context; those two rank 4th and 6th of the default model's 90 KV heads.

``protect_heads = f`` (a fraction in [0, 1)): the ``round(f x N)`` KV heads (of the ``N`` heads of the model's
full-attention layers) with the highest alpha keep every token (:class:`~kvkit.stores.split.HeadSplitStore`'s
whole part); the others are the policy's usual store over those heads only (``num_heads``), with its own
``budget`` per head. Memory: ``f`` of the full KV plus ``(1 - f) x budget`` per token slot; a policy at a target
fraction ``t`` of the context ``S`` takes ``budget = (t - f) / (1 - f) x S``. The pattern is the one shipped for the
model (:data:`~kvkit.policies.duo_patterns.SHIPPED_PATTERNS`) or ``protect_pattern`` (a file or values, as duo's
``pattern``).
"""

from __future__ import annotations

from kvkit.model_info import layer_types as _layer_types
from kvkit.policies.duo import Duo  # the pattern loader and its checks are duo's
from kvkit.policies.duo_patterns import PatternFile
from kvkit.stores.split import HeadSplitStore


def check_protect(policy) -> None:
    """A policy's ``protect_heads`` / ``protect_pattern`` options, checked (ValueError) and frozen: ``protect_heads`` a fraction
    in [0, 1); ``protect_pattern`` (only with ``protect_heads`` > 0) read and checked now, once, as duo reads its
    ``pattern`` (a file's content and sha256 kept, values made a tuple): later caches never re-read the file."""
    who, fraction, pattern = policy.name, policy.protect_heads, policy.protect_pattern
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise ValueError(f"{who}: protect_heads must be a fraction of the KV heads in [0, 1) (0: none protected), got "
                         f"{fraction!r}")
    if pattern is None:
        return
    if not fraction:
        raise ValueError(f"{who}: protect_pattern ranks the heads that protect_heads keeps whole; give protect_heads > 0 too "
                         "(e.g. protect_heads=0.2), or leave protect_pattern out")
    try:
        frozen = Duo(pattern=pattern).pattern
    except ValueError as e:
        raise ValueError(f"{who}: protect_pattern: {e}") from e
    object.__setattr__(policy, "protect_pattern", frozen)


def pattern_hashes(policy, config=None) -> dict:
    """``{"protect_pattern": sha256}`` when the policy read a pattern file (``kvkit.evals.settings.file_hashes``), else {}. With
    the model's ``config`` also the pattern shipped for the model, when
    ``protect_heads`` > 0 ranks by it (no ``protect_pattern`` given): a run's record then changes with that file."""
    p = policy.protect_pattern
    if isinstance(p, PatternFile):
        return {"protect_pattern": p.sha256}
    if p is None and policy.protect_heads and config is not None:
        sha = Duo().pattern_sha256_for(config)
        return {"protect_pattern": sha} if sha is not None else {}
    return {}


def protected_heads(who: str, config, fraction: float, pattern=None):
    """``[L, H]`` bool: True for the KV heads kept whole (the top ``fraction`` by the DuoAttention pattern's alpha,
    ranked over the full-attention layers), or None when ``fraction`` is 0. Raises ``ValueError`` (what to do)
    when no pattern ships for the model and none is given."""
    if not fraction:
        return None
    duo = Duo(pattern=pattern, sparsity=1.0 - float(fraction))
    try:
        return duo.retrieval_heads(config, _layer_types(config))
    except ValueError as e:
        raise ValueError(f"{who}: protect_heads={fraction} ranks the KV heads by a DuoAttention pattern, and {e}. "
                         f"Or run {who} with protect_heads=0") from e


def split_or_plain(info, make, heads):
    """The layer's store: ``make(None)`` over all its KV heads when none of them is protected (``heads``: the
    ``[L, H]`` mask of :func:`protected_heads`, or None), else a :class:`~kvkit.stores.split.HeadSplitStore` with
    the protected heads whole and ``make(n)`` over the other ``n``."""
    keep = None if heads is None else heads[info.layer_idx].tolist()
    if keep is None or not any(keep):
        return make(None)
    return HeadSplitStore(info, keep, make, "protect_heads")


def evicting_parts(cache, cls) -> tuple[list, list]:
    """``(stores, layers)``: the cache's ``cls`` stores (a layer itself, or a head-split layer's evicted part; a layer
    whose heads are all protected has none) and, one per store, the cache layer holding it (what a reconstruction's
    repeat forward rolls back: a split layer rolls both its parts back)."""
    stores, layers = [], []
    for layer in cache.layers:
        part = layer if isinstance(layer, cls) else (
            layer.rest if isinstance(layer, HeadSplitStore) and isinstance(layer.rest, cls) else None)
        if part is not None:
            stores.append(part)
            layers.append(layer)
    return stores, layers
