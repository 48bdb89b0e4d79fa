"""The attention function kvkit registers with transformers: a seam that hands each layer's call to its store."""

from __future__ import annotations

from transformers.integrations.sdpa_attention import sdpa_attention_forward


def kvkit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered under ``"kvkit"``: routes the layer's attention to its policy store.

    Without a kvkit cache (``use_cache=False``, or a user-passed transformers cache) this is plain
    sdpa attention.
    """
    store = getattr(module, "_kvkit_store", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if store is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return store.attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs), None
