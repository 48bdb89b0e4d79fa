"""The attention function kvkit registers with transformers: a seam that hands each layer's call to its store."""

from __future__ import annotations

from transformers.integrations.sdpa_attention import sdpa_attention_forward


def kvkit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kvkit_store=None, **kwargs):
    """Registered under ``"kvkit"``: routes the layer's attention to its policy store.

    The store comes with the call: kvkit's attention pre-hook (``kvkit.patch.attn_pre_hook``) reads it from the cache
    the attention module is given (``cache.layers[module.layer_idx]``) and adds it to the module's keyword arguments,
    which the module's forward passes on here. Nothing is read from the module itself, which every caller shares
    (threads, deep copies). Without a kvkit cache (``use_cache=False``, or a transformers cache under ``full``) this
    is plain sdpa attention.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if kvkit_store is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return kvkit_store.attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs), None
