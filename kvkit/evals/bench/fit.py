"""Byte arithmetic of the batched decode bench: bytes a decode step reads, the speed-up they bound, and the
largest batch whose KV fits in a memory budget (``kvkit bench --batch B --memory GiB``).

A decode step reads the weights once and each sequence's K/V; the byte bound of a policy is the speed-up it
would reach if a step took time in proportion to the bytes it reads.
"""

from __future__ import annotations

import torch

HEADROOM_TOKENS = 64  # decode headroom per sequence in --memory: this many tokens of uncompressed K/V


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings counted once): what every decode
    step reads besides the KV (the embedding lookup reads fewer, the tied lm_head all of it)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def full_token_bytes(model) -> int:
    """K/V bytes one token takes in an uncompressed cache, all layers (the --memory decode headroom unit)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = torch.empty((), dtype=model.dtype).element_size()
    return 2 * cfg.num_hidden_layers * heads * dim * size


def byte_bound(weights: int, full_read: int, read: int) -> float:
    """``(weights + full's KV read per step) / (weights + this policy's KV read per step)``."""
    return (weights + full_read) / max(1, weights + read)


def fraction_of_bound(speedup: float | None, bound: float) -> float | None:
    """``(speedup - 1) / (bound - 1)``: 1 = all the way to the byte bound, 0 = as fast as full; None when the
    policy reads (almost) as much as full (bound < 1.01) and the fraction means nothing."""
    if speedup is None or bound < 1.01:
        return None
    return (speedup - 1) / (bound - 1)


def memory_fit(memory_bytes: float, held_per_seq: float, headroom_per_seq: float) -> int:
    """The largest batch whose KV (``held_per_seq + headroom_per_seq`` bytes per sequence) fits in
    ``memory_bytes``."""
    if memory_bytes <= 0:
        raise ValueError(f"--memory must be positive (GiB), got {memory_bytes / 2**30!r}")
    return int(memory_bytes // max(1.0, held_per_seq + headroom_per_seq))
