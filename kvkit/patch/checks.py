"""The checks a patched model runs on a forward's inputs: token ids / embeddings (:func:`check_inputs`), the
trained context (:func:`check_context`) and a caller's transformers cache (:func:`check_foreign_cache`)."""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import Cache

from kvkit.cache import KVCache
from kvkit.model_info import context_limit
from kvkit.state import patch_state


def check_inputs(args, kwargs) -> None:
    """Refuse a forward's malformed ``input_ids`` (not integer ids, no tokens) or ``inputs_embeds`` (no positions,
    NaN / inf values: a host read, skipped under ``torch.compile``). ``args``/``kwargs``: the forward's."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        if ids.shape[-1] == 0:
            raise ValueError("empty prompt: input_ids has no tokens (give at least one token, e.g. the BOS token)")
    emb = kwargs.get("inputs_embeds")
    if isinstance(emb, torch.Tensor):
        if emb.shape[1] == 0:
            raise ValueError("empty prompt: inputs_embeds has no positions")
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(emb).all()):  # a sync: eager only
            raise ValueError("inputs_embeds contains NaN or inf values")


def check_context(model, cached: int, new: int, where: str = "this forward") -> None:
    """Refuse ``cached + new`` tokens beyond the model's trained context, unless the patch allowed it (warn then).

    Positions past ``max_position_embeddings`` were never trained: RoPE extrapolates and the output degrades
    silently, whatever the policy keeps in its cache (it still uses the true positions).
    """
    limit = context_limit(model)
    total = cached + new
    if limit is None or total <= limit:
        return
    state = patch_state(model)
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    if state is not None and state.allow_beyond_context:
        if not state.warned_beyond_context:
            state.warned_beyond_context = True
            warnings.warn(
                f"kvkit: {total} tokens exceed the trained context of {limit} tokens of {name} "
                "(config.max_position_embeddings); running anyway because of allow_beyond_context=True, "
                "expect degraded output beyond it",
                stacklevel=3,
            )
        return
    have = f"the cache holds {cached} tokens and {where} adds {new}" if cached else f"{where} has {new} tokens"
    raise ValueError(
        f"{total} tokens exceed the trained context of {limit} tokens of {name} (config.max_position_embeddings): "
        f"{have}. Positions beyond it were never trained and output degrades silently. Shorten the prompt so "
        f"prompt + max_new_tokens <= {limit} (e.g. keep its last tokens), or opt in with "
        "kvkit.patch(model, policy, allow_beyond_context=True, ...) to run anyway (a warning is issued)"
    )


def forward_new_tokens(args, kwargs) -> int:
    """The number of new tokens a forward carries (``input_ids``' last dimension, else ``inputs_embeds``' second;
    0 without either). ``args``/``kwargs``: the forward's."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        return ids.shape[-1]
    emb = kwargs.get("inputs_embeds")
    if isinstance(emb, torch.Tensor) and emb.dim() >= 2:
        return emb.shape[1]
    return 0


def check_foreign_cache(model, cache) -> None:
    """Refuse a transformers cache (not a ``KVCache``) handed to a model patched with a compressing policy.

    Attention over such a cache is transformers' exact attention over everything it holds: under ``full`` that *is*
    the policy (the cache is used as is), under any other policy the request would silently run without it. It is
    never swapped for a new cache either (the caller's object would stay empty and the next call that passes it
    would run without the context)."""
    state = patch_state(model)
    if state is None or not isinstance(cache, Cache) or isinstance(cache, KVCache) or state.policy.name == "full":
        return
    name = state.policy.name
    raise ValueError(
        f"a transformers {type(cache).__name__} was passed as the cache of a model patched with {name!r}: attention "
        f"over it would be transformers' own, without {name!r}'s compression (kvkit neither fills nor replaces a cache you "
        f"pass). Pass kvkit.KVCache(model) instead (it carries the context from call to call), or no cache (a new "
        "KVCache is made and returned in the output); or kvkit.unpatch(model) to use transformers' caches"
    )
