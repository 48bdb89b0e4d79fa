"""Prompts of a sample: the text the model reads and its tokens.

:func:`build_prompt`: the chat template around the user message when the tokenizer has one, then the answer prefix
after the generation prompt (as RULER does); without a template the tokenizer's own leading special tokens (e.g.
Llama's BOS) as text, then the message and the prefix. Prompts are tokenized with ``add_special_tokens=False``
(:func:`encode`, :func:`count_tokens`); :func:`check_length` refuses a length above the model's context.
"""

from __future__ import annotations

import torch


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt(tokenizer, user: str, answer_prefix: str = "", chat: bool = True) -> str:
    """The full prompt text: the chat template around ``user`` (when the model has one), then the
    answer prefix after the generation prompt, as RULER does. Tokenize it with ``add_special_tokens=False``."""
    if chat and has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return text + answer_prefix.lstrip(" ")
    return _default_prefix(tokenizer) + user + answer_prefix


def _default_prefix(tokenizer) -> str:
    """The special tokens the tokenizer itself puts in front of a plain text (e.g. Llama's BOS), as text."""
    ids = tokenizer("a")["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(ids) - len(bare)
    return tokenizer.decode(ids[:n]) if n > 0 and ids[n:] == bare else ""


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)



def model_context(model) -> int | None:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return getattr(cfg, "max_position_embeddings", None)


def check_length(model, length: int, what: str = "--length") -> None:
    ctx = model_context(model)
    if ctx is not None and length > ctx:
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise ValueError(f"{what} {length} is above the model's context of {ctx} tokens ({name})")
