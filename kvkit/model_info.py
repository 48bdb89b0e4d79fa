"""What kvkit needs to know about a model: its text config, one ``LayerInfo`` per decoder layer, RoPE tables
for arbitrary positions (from the model's own rotary module) and the rotate-half RoPE algebra."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from kvkit.kernels.reference import apply_rope, rotate_half  # noqa: F401  (re-exported)
from kvkit.stores.base import LayerInfo


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_infos(model_or_config, rope=None) -> list[LayerInfo]:
    config = getattr(model_or_config, "config", model_or_config)
    tc = text_config(config)
    layer_types, per_layer = get_layer_types_and_kwargs(tc)
    heads = tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    infos = []
    for i, (lt, kw) in enumerate(zip(layer_types, per_layer)):
        infos.append(
            LayerInfo(
                layer_idx=i,
                num_layers=len(layer_types),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                layer_type=lt,
                sliding_window=kw.get("sliding_window"),
                config=tc,
                rope=rope,
            )
        )
    return infos


def make_rope_fn(model) -> Callable | None:
    """``positions [B, n] -> (cos, sin) [B, n, D]`` from the model's own rotary embedding module."""
    rotary = None
    for name, mod in model.named_modules():
        if name.endswith("rotary_emb"):
            rotary = mod
            break
    if rotary is None:
        return None
    # Gemma 3 keeps one rotary module with a RoPE per layer type: forward(x, position_ids, layer_type)
    typed = "layer_type" in inspect.signature(rotary.forward).parameters

    def rope(positions: torch.Tensor, dtype=torch.float32, layer_type: str = "full_attention"):
        # computed where the rotary module lives (its inv_freq buffer); returned on the positions' device,
        # which is the calling layer's device also when device_map spreads the layers over several devices
        out_dev = positions.device
        positions = positions.long()
        if positions.dim() == 1:
            positions = positions[None]
        p = next(rotary.buffers(), None)
        dev = positions.device if p is None or p.device.type == "meta" else p.device
        x = torch.zeros(1, dtype=dtype, device=dev)
        if typed:
            cos, sin = rotary(x, positions.to(dev), layer_type)
        else:
            cos, sin = rotary(x, positions.to(dev))
        return cos.to(out_dev), sin.to(out_dev)

    def params(layer_type: str = "full_attention"):
        """``(inv_freq [Dr/2] fp32, attention_scaling)`` of the rotary module (for kernels that evaluate RoPE
        themselves), or None when it keeps no plain ``inv_freq``."""
        pre = f"{layer_type}_" if typed else ""
        inv = getattr(rotary, pre + "inv_freq", None)
        if not isinstance(inv, torch.Tensor) or inv.dim() != 1:
            return None
        return inv, float(getattr(rotary, pre + "attention_scaling", 1.0) or 1.0)

    rope.params = params
    return rope


# ---- RoPE algebra (transformers' rotate_half convention) --------------------------------------------
# apply_rope / rotate_half: the one implementation, in kvkit.kernels.reference (kernels never import this module)


def inverse_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`apply_rope`: ``k = a R(theta) x``  ->  ``x = R(-theta) k / a``."""
    dr = cos.shape[-1]
    rot, rest = k[..., :dr], k[..., dr:]
    x = (rot * cos - rotate_half(rot) * sin) / (cos * cos + sin * sin)
    return x if dr == k.shape[-1] else torch.cat([x, rest], dim=-1)


def context_limit(model) -> int | None:
    """The model's trained context (``max_position_embeddings`` of its text config), or None if unknown."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    tc = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = getattr(tc, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None
