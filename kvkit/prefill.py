"""Chunked prefill: run a long prompt through a patched model in chunks so peak memory stays bounded.

The first chunk gets exact attention; later chunks attend to what the policy kept plus themselves
(causal), and compressing policies compress between chunks, so a store never holds much more than
its budget plus one chunk. Hand the returned cache to ``generate`` to continue::

    cache, logits = kvkit.prefill(model, ids[:, :-1], chunk_size=1024)
    out = model.generate(ids, **cache_kw(cache), max_new_tokens=64)  # kvkit.compat.cache_kw
"""

from __future__ import annotations

import torch

from kvkit.cache import KVCache
from kvkit.compat import cache_kw
from kvkit.patch import check_context


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, chunk_size: int = 2048,
            cache: KVCache | None = None):
    """Feed ``input_ids [B, T]`` in chunks of ``chunk_size``; returns ``(cache, logits of the last token [B, V])``.

    Cached + prompt tokens beyond the model's trained context (``max_position_embeddings``) raise a
    ``ValueError`` unless the model was patched with ``allow_beyond_context=True``.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if input_ids.shape[-1] == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    # a new cache's first forward is the first chunk: a static one resolves a compression_ratio for its length
    cache = cache if cache is not None else KVCache(model, prompt_length=min(input_ids.shape[1], chunk_size))
    start = cache.get_seq_length()
    T = input_ids.shape[1]
    # refuse before the first chunk runs, not at the chunk that crosses the limit
    check_context(model, start, T, where="the prompt given to kvkit.prefill")
    if attention_mask is not None and attention_mask.shape[1] != start + T:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} positions, expected cached {start} + prompt {T}"
        )
    positions = None
    if attention_mask is not None:  # same position ids as generate() uses for left padding
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = None
    for s in range(0, T, chunk_size):
        e = min(T, s + chunk_size)
        kwargs = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask[:, : start + e]
            kwargs["position_ids"] = positions[:, start + s : start + e]
        out = model(input_ids=input_ids[:, s:e], **cache_kw(cache), use_cache=True, logits_to_keep=1, **kwargs)
        logits = out.logits[:, -1]
    return cache, logits
