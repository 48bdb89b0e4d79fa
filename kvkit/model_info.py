"""What kvkit needs to know about a model: its text config, one ``LayerInfo`` per decoder layer, RoPE tables
for arbitrary positions (from the model's own rotary module) and the rotate-half RoPE algebra."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvkit.kernels.reference import apply_rope, rotate_half  # noqa: F401  (re-exported)


@dataclass
class LayerInfo:
    """What a store needs to know about its layer."""

    layer_idx: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    layer_type: str = "full_attention"
    sliding_window: int | None = None
    config: Any = None  # the decoder's text config
    rope: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)
    #: the policy's cross-layer state of one KVCache (``Policy.new_shared``; e.g. TidalDecode's selection)
    shared: Any = field(default=None, repr=False)
    #: build the static (compileable) variant of the store: fixed-capacity buffers written at an index tensor,
    #: lengths on the device (``KVCache(..., static=True)``); policies without one refuse it
    static: bool = False
    #: the least capacity, in tokens, of a static store's uncompressed buffers (None: sized at the prefill)
    max_length: int | None = None
    #: the length of the cache's first forward (``KVCache(..., prompt_length=n)``): a static store resolves its
    #: ``compression_ratio`` knobs for it when built (:func:`kvkit.policies.knobs.static_prompt`); None: not declared
    prompt_length: int | None = None
    #: the element size of the K/V the cache will hold (the model's parameters'), for knobs resolved before any
    #: K/V exists (a static store's, from ``prompt_length``); None: not known
    element_size: int | None = None

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


#: ``layer_types`` entries of layers that attend over a bounded window, and where the window comes from
_WINDOW_FIELD = {
    "sliding_attention": "sliding_window",
    "hybrid_sliding": "sliding_window",
    "reference_sliding_attention": "sliding_window",
    "chunked_attention": "attention_chunk_size",
}


def _layer_configs(tc) -> list:
    """One config per decoder layer: a heterogeneous config's own per-layer views (transformers >= 5.19's
    ``per_layer_config``), else the text config itself for every layer."""
    n = tc.num_hidden_layers
    if getattr(tc, "is_heterogeneous", False):
        return list(tc.per_layer_config)
    return [tc] * n


def layer_types_and_windows(config) -> tuple[list[str], list[int | None]]:
    """``(layer_types, sliding_windows)``, one entry per decoder layer, read from the config itself.

    The same rules as transformers' ``get_layer_types_and_kwargs`` of 5.24, on every release kvkit supports (the
    helper does not exist before 5.14, and returns one dict for all layers before 5.19): ``layer_types`` when the
    config has it, else ``sliding_attention`` / ``chunked_attention`` / ``full_attention`` per layer from its
    ``sliding_window`` / ``attention_chunk_size``; layers that keep no KV of their own (KV shared with another
    layer, MoE/MLP-only layers) are ``"dummy"``. The window of a sliding layer is its ``sliding_window`` (its
    ``attention_chunk_size`` for a chunked one), None for the others. Always ``num_hidden_layers`` entries.
    """
    tc = text_config(config)
    n = tc.num_hidden_layers
    per_layer = _layer_configs(tc)
    layer_types = getattr(tc, "layer_types", None)
    if layer_types is None:
        layer_types = []
        for lc in per_layer:
            if getattr(lc, "sliding_window", None) is not None:
                layer_types.append("sliding_attention")
            elif getattr(lc, "attention_chunk_size", None) is not None:
                layer_types.append("chunked_attention")
            else:
                layer_types.append("full_attention")
    layer_types = list(layer_types)
    if len(layer_types) != n:
        raise ValueError(
            f"the config of {tc.model_type!r} lists {len(layer_types)} layer_types for {n} layers "
            "(num_hidden_layers): kvkit cannot tell which layer is which"
        )
    # layers that reuse another layer's KV keep none (Gemma 3n, Gemma 4): transformers >= 5.24 says so per layer
    # (kv_sharing_modes), earlier releases by the count of the last layers (num_kv_shared_layers)
    modes = getattr(tc, "kv_sharing_modes", None)
    if modes is not None:
        layer_types = ["dummy" if m == "reuse" else t for t, m in zip(layer_types, modes)]
    else:
        shared = getattr(tc, "num_kv_shared_layers", None) or 0
        if shared > 0:
            layer_types = layer_types[: n - shared] + ["dummy"] * shared
    layer_types = ["dummy" if t in ("moe", "mlp") else t for t in layer_types]
    windows = []
    for t, lc in zip(layer_types, per_layer):
        field_name = _WINDOW_FIELD.get(t)
        windows.append(getattr(lc, field_name, None) if field_name else None)
    return layer_types, windows


def layer_infos(model_or_config, rope=None) -> list[LayerInfo]:
    """One :class:`LayerInfo` per decoder layer (``num_hidden_layers`` of them), built from the config
    (:func:`layer_types_and_windows`); the same on every transformers release kvkit supports."""
    config = getattr(model_or_config, "config", model_or_config)
    tc = text_config(config)
    layer_types, windows = layer_types_and_windows(tc)
    heads = tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    return [
        LayerInfo(
            layer_idx=i,
            num_layers=len(layer_types),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            layer_type=lt,
            sliding_window=w,
            config=tc,
            rope=rope,
        )
        for i, (lt, w) in enumerate(zip(layer_types, windows))
    ]


def layer_types(config) -> list[str]:
    """The decoder layers' types (``full_attention``, ``sliding_attention``, ...): :func:`layer_types_and_windows`."""
    return layer_types_and_windows(config)[0]


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
