"""The options every policy shares: ``compression_ratio`` (one compression knob for every method) and ``preset``.

``compression_ratio = r`` (a fraction in (0, 1)): the fraction of ``full``'s KV bytes a decode step no longer reads
(``KVCache.read_nbytes``); for a policy that evicts, merges or quantizes, also the memory it saves. Each policy maps
it to its native knobs (:meth:`~kvkit.policies.base.Policy.ratio_knobs` names them):

* a token budget (``streaming``, ``snapkv``, ``cake``, ``kvzip``, ``tidal``'s selection, ``shadowkv``'s sparse
  budget) and a merge ratio that has exact tokens beside it (``chelsea``) are resolved from the context length when
  the prompt arrives (the first forward's length, padding included; kvzip's reconstruction re-resolves it at every
  multi-token forward from the tokens seen so far; single-token decode steps keep it);
* ``duo``'s sparsity (the share of streaming heads) also depends on the context length (a streaming head keeps
  ``sink + recent`` tokens): its heads are split at the first forward;
* ``zipcache``'s bit widths and high-precision share depend on the model's element size only
  (``Policy.ratio_needs_length`` False).

A static cache (``KVCache(..., static=True)``) sizes its buffers before the prompt arrives, so a policy whose mapping
depends on the length needs it declared: ``KVCache(..., static=True, prompt_length=n)`` (:func:`static_prompt`;
kvkit's ``generate``, ``kvkit.prefill``, the shared-prefill replay and the evals pass it). Its stores resolve the
knob for ``n`` tokens when built, by the formula the growing cache applies at its prefill (a cost per slot from the
model's element size, ``LayerInfo.element_size``), and the prefill resolves it again from the K/V it holds, as the
growing cache does: a first forward of ``n`` tokens gives the same knob, the same kept slots and the same
``read_nbytes``. The cache refuses a first forward of another length (``KVCache.update``: ValueError), and a static
cache with such a ratio and no ``prompt_length`` is refused when built (ValueError: pass ``prompt_length`` or the
native knob).

Giving ``compression_ratio`` together with a native knob set away from its default is refused (ValueError: one or
the other); a ratio the policy cannot reach is refused with the range it can reach.

``preset``: ``"kvkit"`` (default: kvkit's settings, e.g. retrieval heads protected where a head pattern ships) or
``"paper"`` (each paper's own settings, for published numbers; options the user gives still win).
"""

from __future__ import annotations

import dataclasses
import warnings

from kvkit.model_info import layer_types

PRESETS = ("kvkit", "paper")


#: the share of the context a head that does not keep every token keeps by default under ``compression_ratio``: each
#: evicting head of the ``protect_heads`` policies (:func:`kvkit.policies.protect_heads.default_protect`), each
#: streaming head of duo (:meth:`kvkit.policies.duo.Duo.recent_for`); results/needles/README.md
EVICTED_SHARE = 1 / 6


def field_defaults(policy) -> dict:
    out = {}
    for f in dataclasses.fields(policy):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def check_common(policy) -> None:
    """``preset`` and ``compression_ratio`` checked (ValueError); ``preset="paper"`` fills the paper's settings
    (``Policy.paper``) into the options the user left at their defaults. Called by every policy's ``__post_init__``."""
    who, preset, r = policy.name, policy.preset, policy.compression_ratio
    if preset not in PRESETS:
        raise ValueError(f"{who}: preset must be one of {', '.join(PRESETS)} ('kvkit': kvkit's defaults, 'paper': "
                         f"the paper's own settings), got {preset!r}")
    defaults = field_defaults(policy)
    if preset == "paper":
        for k, v in type(policy).paper.items():
            if getattr(policy, k) == defaults.get(k):
                object.__setattr__(policy, k, v)
    if r is None:
        return
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1:
        raise ValueError(f"{who}: compression_ratio must be a fraction in (0, 1) (the share of full's KV reads a "
                         f"decode step saves; 0.5 = half), got {r!r}")
    knobs = type(policy).ratio_knobs
    if not knobs:
        raise ValueError(f"{who} compresses nothing: compression_ratio does not apply (use another policy)")
    paper = type(policy).paper if preset == "paper" else {}
    given = [k for k in knobs if getattr(policy, k) != paper.get(k, defaults.get(k))]
    if given:
        raise ValueError(f"{who}: compression_ratio={r} sets {', '.join(knobs)} itself; give compression_ratio or "
                         f"{' / '.join(given)}={getattr(policy, given[0])!r}, not both")


def unreachable(who: str, r: float, low: float, high: float, why: str) -> ValueError:
    return ValueError(f"{who}: compression_ratio={r:g} is out of reach ({why}); this policy reaches compression "
                      f"ratios in [{low:.3f}, {high:.3f}] here")


def budget_for(who: str, r: float, context: int, protected: float = 0.0, floor: int = 1, cost: float = 1.0) -> int:
    """Per-head token budget that reads ``1 - r`` of a ``context``-token cache: with a ``protected`` fraction of the
    KV heads kept whole, the others keep ``b`` slots of ``cost`` times a token's K/V bytes each (its metadata, e.g. an
    int32 position: :func:`slot_cost`) with ``protected + (1 - protected) * cost * b / context = 1 - r``. At least
    ``floor`` (the tokens the policy always keeps): below it the ratio is out of reach for this context, which
    policy ``who`` says once in a warning (:func:`floor_warning`) rather than failing a generation."""
    b = int(round(((1.0 - r) - protected) / (1.0 - protected) * context / cost))
    if b < floor:
        reads = min(1.0, protected + (1.0 - protected) * cost * floor / max(context, 1))
        floor_warning(who, r, reads, f"a {context}-token context asks for {max(b, 0)} tokens per evicting head, "
                      f"fewer than the {floor} it always keeps")
    return max(b, floor)


def floor_warning(who: str, r: float, reads: float, why: str) -> None:
    """Once per (policy, ratio): ``compression_ratio=r`` is out of reach for a context (``why``); the policy keeps
    its floor and reads about ``reads`` of full's bytes."""
    warn_once((who, "floor", r), f"{who}: compression_ratio={r:g} is out of reach here: {why}; it keeps those, "
              f"reading about {reads:.2f} of full's KV bytes instead of {1 - r:.2f}. Use a longer context or a smaller "
              "ratio")


def slot_cost(keys, extra_bytes: int = 4, heads_sharing: int = 1) -> float:
    """A held slot's bytes per KV head over its K/V bytes: ``1 + extra / (2 D e)`` for ``extra_bytes`` of metadata
    per slot (an int32 position: 4) shared by ``heads_sharing`` heads; ``keys [B, H, n, D]`` gives ``D`` and ``e``."""
    return 1.0 + extra_bytes / heads_sharing / (2 * keys.shape[-1] * keys.element_size())


def protected_share(mask, config) -> float:
    """Fraction of the KV heads of the full-attention layers that a ``[L, H]`` protection mask keeps whole (0 for
    None)."""
    if mask is None:
        return 0.0
    types = layer_types(config)
    rows = [i for i, t in enumerate(types) if t == "full_attention"] or list(range(mask.shape[0]))
    return float(mask[rows].float().mean())


_WARNED: set = set()


def warn_once(key, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen in this process."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, stacklevel=3)


def static_prompt(policy, info) -> int | None:
    """The prompt length a static store resolves ``policy``'s ratio-derived knob for when built: ``info.prompt_length``
    for a static store under a ``compression_ratio`` whose mapping depends on the length
    (``Policy.ratio_needs_length``), None otherwise (a growing store resolves it at its prefill). Raises ValueError
    when that length was not declared: a static cache's buffers exist before its prompt."""
    if not info.static or policy.compression_ratio is None or not type(policy).ratio_needs_length:
        return None
    if info.prompt_length is None:
        knobs = " / ".join(policy.ratio_knobs)
        raise ValueError(f"{policy.name}: compression_ratio resolves its {knobs} from the prompt length, which a static "
                         f"cache needs before its buffers are sized: pass prompt_length=<tokens of the first forward, "
                         f"padding included> (KVCache(..., static=True, prompt_length=n)), or give "
                         f"{policy.ratio_knobs[0]}=... instead of compression_ratio")
    return info.prompt_length


def build_slot_cost(info, extra_bytes: int = 4, heads_sharing: int = 1) -> float:
    """:func:`slot_cost` before any K/V exists (a static store resolving its knob when built): ``head_dim`` from
    ``info``, the element size of the model's parameters (``info.element_size``; 2 when unknown)."""
    e = info.element_size or 2
    return 1.0 + extra_bytes / heads_sharing / (2 * info.head_dim * e)
