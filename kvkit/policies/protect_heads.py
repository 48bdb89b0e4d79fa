"""``protect_heads``: the eviction policies' protected heads -- the KV heads a DuoAttention pattern ranks as retrieval
heads keep every token; the policy evicts only in the others (kvkit, after RazorAttention / HeadKV).

Why (results/needles/README.md): question-agnostic, an eviction policy scores the context
without the question, and on the default model the heads that read a needle's value when the question comes (two
heads, attention on the value up to 0.99) rank those tokens low under every question-agnostic score tried (the
context's last queries, its reconstruction): per-head eviction removes the value from exactly the heads that
answer. DuoAttention's calibrated gate (alpha per KV head, ``kvkit calibrate duo``) names the heads that need the
whole context; those two rank 4th and 6th of the default model's 90 KV heads.

``protect_heads = f`` (a fraction in [0, 1); None, the default: :func:`default_protect` where a DuoAttention pattern
ships for the model or ``protect_pattern`` is given, else 0 with a one-time warning; ``preset="paper"``: 0): the
``round(f x N)`` KV heads (of the ``N`` heads of the model's
full-attention layers) with the highest alpha keep every token (:class:`~kvkit.stores.split.HeadSplitStore`'s
whole part); the others are the policy's usual store over those heads only (``num_heads``), with its own
``budget`` per head. Memory: ``f`` of the full KV plus ``(1 - f) x budget`` per token slot; a policy at a target
fraction ``t`` of the context ``S`` takes ``budget = (t - f) / (1 - f) x S``. The pattern is the one shipped for the
model (:data:`~kvkit.policies.duo_patterns.SHIPPED_PATTERNS`) or ``protect_pattern`` (a file or values, as duo's
``pattern``).

The default share follows the compression ratio (:func:`default_protect`): with ``compression_ratio = r`` the
protected share is the one that leaves each evicting head :data:`EVICTED_SHARE` of the context,
``f = (1 - r - e) / (1 - e)`` with ``e = 1/6`` (0.4 at r = 0.5, 0.1 at r = 0.75, none from r = 5/6 on); with a
token ``budget`` (no ratio) it is :data:`DEFAULT_PROTECT`. Measured on the fresh-needle sets
(results/needles/README.md): at r = 0.5 a share of 0.4 keeps more of full's needles than 0.2 or 0.3 for snapkv and
chelsea, at r = 0.75 a share of 0.1 more than 0, 0.05 or 0.2 for snapkv, cake and chelsea (Qwen2.5-Coder-0.5B, not
used to choose: 0.4 keeps every needle at r = 0.5) -- at a fixed byte total each protected head costs its evicting
heads' budget, and below about a sixth of the context the evicting heads start losing what the answer needs. CAKE,
whose cascade spreads the evicting heads' slots unevenly over the layers, keeps more at r = 0.5 with 0.3 (one needle
more on each set, and on the held-out essays, which were not used to choose; Qwen: every needle either way): its
:attr:`ProtectHeads.protect_knots` take 0.3 there and the rule's 0.7 and 0.1 at 0.25 and 0.75.
"""

from __future__ import annotations

from typing import ClassVar

from kvkit.model_info import layer_types as _layer_types
from kvkit.policies.duo import Duo  # the pattern loader and its checks are duo's
from kvkit.policies.duo_patterns import PatternFile, model_identity, shipped_pattern
from kvkit.policies.knobs import EVICTED_SHARE, protected_share, unreachable, warn_once
from kvkit.stores.split import HeadSplitStore

#: ``protect_heads`` left at None where a head pattern ships and the size is a token ``budget`` (no
#: ``compression_ratio``): the share of KV heads kept whole
DEFAULT_PROTECT = 0.2



def default_protect(r: float | None, knots: tuple[tuple[float, float], ...] = ()) -> float:
    """The ``protect_heads`` a policy takes by default where a head pattern is available: :data:`DEFAULT_PROTECT`
    without a ratio; with ``compression_ratio = r``, the share ``f`` whose protected heads (whole) and evicting heads
    (:data:`EVICTED_SHARE` of the context each) read ``1 - r`` together, ``f + (1 - f) e = 1 - r``; 0 where
    ``1 - r <= e``. ``knots`` (a policy's :attr:`ProtectHeads.protect_knots`): measured ``(r, f)`` pairs, ascending in
    ``r``; between the first and the last knot ``f`` is linear between neighbouring knots, outside them the rule
    above."""
    if r is None:
        return DEFAULT_PROTECT
    if knots and knots[0][0] <= r <= knots[-1][0]:
        for (r0, f0), (r1, f1) in zip(knots, knots[1:]):
            if r <= r1:
                return f0 + (f1 - f0) * (r - r0) / (r1 - r0)
        return knots[-1][1]  # a single knot, r on it
    return max(0.0, (1.0 - r - EVICTED_SHARE) / (1.0 - EVICTED_SHARE))


def check_protect(policy) -> None:
    """A policy's ``protect_heads`` / ``protect_pattern`` options, checked (ValueError) and frozen: ``protect_heads`` a fraction
    in [0, 1); ``protect_pattern`` (only with ``protect_heads`` > 0) read and checked now, once, as duo reads its
    ``pattern`` (a file's content and sha256 kept, values made a tuple): later caches never re-read the file."""
    who, fraction, pattern = policy.name, policy.protect_heads, policy.protect_pattern
    r = policy.compression_ratio
    if fraction is None:
        if pattern is not None:
            object.__setattr__(policy, "protect_pattern", _frozen(who, pattern))
        return
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise ValueError(f"{who}: protect_heads must be a fraction of the KV heads in [0, 1) (0: none protected), got "
                         f"{fraction!r}")
    if r is not None and r >= 1 - fraction:
        raise unreachable(who, r, 0.0, 1 - fraction, f"protect_heads={fraction:g} keeps that share of the KV heads "
                          "whole")
    if pattern is None:
        return
    if not fraction:
        raise ValueError(f"{who}: protect_pattern ranks the heads that protect_heads keeps whole; give protect_heads > 0 too "
                         "(e.g. protect_heads=0.2), or leave protect_pattern out")
    object.__setattr__(policy, "protect_pattern", _frozen(who, pattern))


def _frozen(who, pattern):
    try:
        return Duo(pattern=pattern).pattern
    except ValueError as e:
        raise ValueError(f"{who}: protect_pattern: {e}") from e


def protect_fraction(policy, config) -> float:
    """The ``protect_heads`` in effect for a model: the option; with None, :func:`default_protect` of the policy's
    ``compression_ratio`` when a pattern is given or ships for the model, else 0, warning once (what it falls back
    to, how to calibrate)."""
    if policy.protect_heads is not None:
        return float(policy.protect_heads)
    if policy.protect_pattern is not None:
        return default_protect(policy.compression_ratio, getattr(policy, "protect_knots", ()))
    path = shipped_pattern(config) if config is not None else None
    if path is not None and path.is_file():
        return default_protect(policy.compression_ratio, getattr(policy, "protect_knots", ()))
    ident = model_identity(config) if config is not None else {}
    name = getattr(config, "_name_or_path", "") or ""
    what = repr(name) if name else f"this {ident.get('model_type', '')} model".replace("  ", " ")
    warn_once(("protect_heads", policy.name, name, str(ident)),
              f"{policy.name}: no DuoAttention head pattern ships for {what}, so it evicts in every KV head "
              f"(protect_heads=0), which can lose answers the retrieval heads need. Calibrate one with `kvkit calibrate "
              f"duo --model {name or '<model>'} --out pattern.json` and pass protect_pattern='pattern.json', or pass "
              f"protect_heads=0 to silence this")
    return 0.0


def pattern_hashes(policy, config=None) -> dict:
    """``{"protect_pattern": sha256}`` when the policy read a pattern file (``kvkit.evals.settings.file_hashes``), else {}. With
    the model's ``config`` also the pattern shipped for the model, when
    ``protect_heads`` > 0 ranks by it (no ``protect_pattern`` given): a run's record then changes with that file."""
    p = policy.protect_pattern
    if isinstance(p, PatternFile):
        return {"protect_pattern": p.sha256}
    if p is None and config is not None and protect_fraction(policy, config):
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


class ProtectHeads:
    """What the eviction policies with ``protect_heads`` share (snapkv, cake, kvzip, chelsea): the checks, the
    cache's protection mask (``new_shared``, wrapped by :meth:`shared_state`), the model check and the pattern's
    hash. A policy mixes it in before :class:`~kvkit.policies.base.Policy`."""

    #: measured ``(compression_ratio, protect_heads)`` pairs that replace :func:`default_protect`'s rule between the
    #: first and the last (linear between neighbours); empty: the rule everywhere
    protect_knots: ClassVar[tuple[tuple[float, float], ...]] = ()

    def shared_state(self, mask):
        """The cache's shared state around the ``[L, H]`` protection mask (or None); default: the mask itself."""
        return mask

    def protection(self, config):
        """``[L, H]`` bool mask of the KV heads kept whole for this model, or None; ``compression_ratio`` beyond
        what the protected heads leave is refused here (ValueError with the reachable range)."""
        fraction = protect_fraction(self, config)
        mask = protected_heads(self.name, config, fraction, self.protect_pattern)
        r, share = self.compression_ratio, protected_share(mask, config)
        if r is not None and 1 - r <= share:
            raise unreachable(self.name, r, 0.0, 1 - share, f"protect_heads keeps {share:.3f} of the KV heads whole; "
                              "give protect_heads=0 for more")
        return mask

    def new_shared(self, infos):
        return self.shared_state(self.protection(infos[0].config))

    def validate(self, config) -> None:
        self.protection(config)
