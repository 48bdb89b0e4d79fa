"""DuoAttention calibration's mixed attention: an attention function registered with ``AttentionInterface`` under
:data:`ATTN_NAME` for a calibration's duration. Teacher pass: full causal attention, recorded per layer; mixed pass:
``(1 - alpha) * streaming + alpha * full`` per KV head (:func:`duo_calibration_attention`), its per-pass state
(:class:`CalibrationState`) handed through the forward's keyword arguments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from kvkit.model_info import layer_infos

ATTN_NAME = "kvkit_duo_calibrate"


def streaming_mask(T: int, sink: int, recent: int, device=None) -> torch.Tensor:
    """``[T, T]`` bool: query i reads key j when j <= i and (j < sink or j > i - recent)."""
    i = torch.arange(T, device=device).view(T, 1)
    j = torch.arange(T, device=device).view(1, T)
    return (j <= i) & ((j < sink) | (j > i - recent))


def sliding_mask(T: int, window: int, device=None) -> torch.Tensor:
    """``[T, T]`` bool: the model's own sliding window (query i reads key j when i - window < j <= i)."""
    i = torch.arange(T, device=device).view(T, 1)
    j = torch.arange(T, device=device).view(1, T)
    return (j <= i) & (j > i - window)


class CalibrationState:
    """Per-forward state handed to :func:`duo_calibration_attention` through the forward's kwargs.

    ``windows`` maps the layers the model itself runs with a sliding window (Gemma 2/3 local layers,
    Mistral) to their window: those layers are not gated (kvkit leaves them to the model's own window),
    so teacher and mixed pass both run them with exactly that window.
    """

    def __init__(self, gates: torch.Tensor, sink: int, recent: int, windows: dict[int, int] | None = None):
        self.gates = gates  # [L, Hkv]
        self.sink, self.recent = sink, recent
        self.windows = dict(windows or {})
        self.mode = "teacher"
        self.full: dict[int, torch.Tensor] = {}
        self.mask: torch.Tensor | None = None
        self.window_masks: dict[tuple[int, int], torch.Tensor] = {}


def duo_calibration_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Teacher mode: full causal attention, recorded per layer. Mixed mode: gate-weighted mix of this
    pass's streaming attention and the teacher's full attention. ``query [B, Hq, T, D]`` -> ``[B, T, Hq, D]``."""
    state: CalibrationState = kwargs["duo_calibration"]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    G = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, G), repeat_kv(value, G)
    layer = module.layer_idx
    T = query.shape[2]
    window = state.windows.get(layer)
    if window is not None:  # the model's own sliding-window layer: never gated, same in both passes
        if window >= T:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling).transpose(1, 2), None
        if (window, T) not in state.window_masks:
            state.window_masks[(window, T)] = sliding_mask(T, window, query.device)
        mask = state.window_masks[(window, T)]
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling).transpose(1, 2), None
    if state.mode == "teacher":
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling).transpose(1, 2)
        state.full[layer] = out.detach()
        return out, None
    if state.mask is None or state.mask.shape[0] != T:
        state.mask = streaming_mask(T, state.sink, state.recent, query.device)
    stream = F.scaled_dot_product_attention(query, key, value, attn_mask=state.mask, scale=scaling).transpose(1, 2)
    alpha = state.gates[layer].clamp(0, 1).repeat_interleave(G).to(stream.dtype).view(1, 1, -1, 1)
    return (1 - alpha) * stream + alpha * state.full[layer], None


def sliding_windows(config) -> dict[int, int]:
    """``{layer: window}`` for the layers the model runs with its own sliding window (as ``KVCache`` does)."""
    return {
        info.layer_idx: int(info.sliding_window)
        for info in layer_infos(config)
        if info.layer_type == "sliding_attention" and info.sliding_window
    }
