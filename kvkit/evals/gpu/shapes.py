"""The model shapes ``kvkit bench --shape NAME`` builds: transformers ``LlamaConfig`` fields by name, and a
random-weight ``LlamaForCausalLM`` of one built straight on the device.

Shapes (:data:`SHAPES`): ``tiny`` (2 layers, 4 query / 2 KV heads of 16, vocabulary 256, tied embeddings: the CPU
tests' shape), ``llama-3.2-1b`` (16 layers, 32 / 8 heads of 64, tied embeddings, llama3 RoPE scaling x32) and
``llama-3.1-8b`` (32 layers, 32 / 8 heads of 128, untied, x8). :func:`build_model` makes the model under
``torch.device(dev)`` (no host copy of the weights), seeded, then ``.to(dtype)``, eval mode, sdpa attention;
nothing is downloaded.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _llama3_rope(factor: float) -> dict:
    return dict(rope_type="llama3", rope_theta=500000.0, factor=factor, high_freq_factor=4.0, low_freq_factor=1.0,
                original_max_position_embeddings=8192)


#: model shapes (transformers ``LlamaConfig`` fields); random weights of these are built on the device
SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=131072, tie_word_embeddings=True,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters=_llama3_rope(32.0)),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters=_llama3_rope(8.0)),
}


def shape_config(name: str) -> LlamaConfig:
    """The ``LlamaConfig`` of shape ``name`` (ValueError naming the known shapes otherwise)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return LlamaConfig(**SHAPES[name])


def build_model(shape: str, device, dtype, seed: int = 0) -> LlamaForCausalLM:
    """Random-weight ``LlamaForCausalLM`` of ``shape`` built on ``device`` in ``dtype``, eval mode, sdpa attention."""
    cfg = shape_config(shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()
