"""``KVCache``: a ``transformers.Cache`` whose layers are kvkit policy stores.

Every store counts the tokens it has *seen* (``get_seq_length``), so position ids stay right after
eviction, and reports the bytes it really holds (``nbytes``). Stores of compressing policies keep
each slot's absolute position, so they build their own attention masks instead of trusting the
generic position-indexed mask of transformers (after eviction column j no longer means position j).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from kvkit.attention import attend_slots, causal_suffix_attention, hf_sdpa, plain_sdpa_call


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
    #: one dict shared by all layers of a KVCache (cross-layer state, e.g. TidalDecode's selection)
    shared: dict = field(default_factory=dict, repr=False)

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class StoreMixin:
    """What every kvkit layer store adds to transformers' ``CacheLayerMixin``."""

    info: LayerInfo

    def nbytes(self) -> int:
        """Bytes of KV data (and slot metadata) this layer holds on its device."""
        raise NotImplementedError

    def offloaded_nbytes(self) -> int:
        """Bytes this layer keeps off-device (e.g. ShadowKV's value store)."""
        return 0

    def read_nbytes(self) -> int:
        """K/V bytes one single-token decode step's attention reads from this layer (on-device data plus
        what it fetches from an offload store). Default: everything held on the device; policies that
        read a subset (TidalDecode's selected tokens, ShadowKV's chunks) override it."""
        return self.nbytes()

    def num_slots(self) -> int:
        """Token slots held (max over heads)."""
        raise NotImplementedError

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """Attention of ``query [B, Hq, T, D]`` for this layer; returns ``[B, T, Hq, D]``."""
        raise NotImplementedError


class FullStore(StoreMixin, DynamicLayer):
    """No compression: exactly transformers' ``DynamicLayer`` (bit-identical attention), plus accounting.

    ``suffix_attention`` (set by :func:`kvkit.speculative` around its verification forwards only):
    multi-token forwards use :func:`kvkit.attention.causal_suffix_attention` (same math, not the same bits).
    """

    suffix_attention = False
    headroom = 64  # slots allocated past the held tokens, so decoding does not copy the whole KV every step

    def __init__(self, info: LayerInfo, **kwargs):
        super().__init__(**kwargs)
        self.info = info
        self._kbuf = self._vbuf = None

    @staticmethod
    def _prefix_of(x, buf) -> bool:
        return (buf is not None and x is not None and x.dim() == 4 and x.data_ptr() == buf.data_ptr()
                and x.stride() == buf.stride() and x.shape[:2] == buf.shape[:2] and x.shape[3] == buf.shape[3])

    def update(self, key_states, value_states, *args, **kwargs):
        """Append into preallocated storage: same values as ``DynamicLayer``'s ``torch.cat``, but the held K/V
        are a prefix view of a buffer with ``headroom`` free slots, re-allocated (one copy) only when full,
        instead of a copy of the whole layer at every decode step (``kvkit speculate --baselines dynamic``:
        plain decoding 1.10x / 1.33x as fast as transformers' DynamicCache in 2 of 3 CPU runs, equal in the
        third, ``results/speculative``).
        Crops shrink the view; the next update writes over the cropped slots. Anything that replaced
        ``keys`` (beam reordering, offloading) is detected and copied into a fresh buffer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        kb, vb = self._kbuf, self._vbuf
        if not (n and self._prefix_of(self.keys, kb) and self._prefix_of(self.values, vb) and n + t <= kb.shape[2]
                and kb.shape[:2] == key_states.shape[:2] and kb.dtype == key_states.dtype and kb.device == key_states.device):
            B, H = key_states.shape[:2]
            cap = n + t + self.headroom
            kb = key_states.new_empty(B, H, cap, key_states.shape[-1])
            vb = value_states.new_empty(B, H, cap, value_states.shape[-1])
            if n:
                kb[:, :, :n].copy_(self.keys)
                vb[:, :, :n].copy_(self.values)
            self._kbuf, self._vbuf = kb, vb
        kb[:, :, n : n + t].copy_(key_states)
        vb[:, :, n : n + t].copy_(value_states)
        self.keys, self.values = kb[:, :, : n + t], vb[:, :, : n + t]
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()

    def allocated_nbytes(self) -> int:
        """Bytes of the buffers, headroom included (``nbytes`` counts the held tokens only)."""
        return _tensor_bytes(self._kbuf, self._vbuf) if self._kbuf is not None else self.nbytes()

    def nbytes(self) -> int:
        return _tensor_bytes(self.keys, self.values) if self.is_initialized else 0

    def num_slots(self) -> int:
        return self.get_seq_length()

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if self.suffix_attention and not dropout and plain_sdpa_call(kwargs):
            out = causal_suffix_attention(query, key, value, attention_mask, scaling)
            if out is not None:
                return out
        return hf_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


class SlidingStore(StoreMixin, DynamicSlidingWindowLayer):
    """A layer the model itself runs with a sliding window (Mistral, Gemma 2/3 local layers).

    Policies leave these layers to the model's own window: they are already bounded.
    """

    def __init__(self, info: LayerInfo, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.info = info

    def nbytes(self) -> int:
        return _tensor_bytes(self.keys, self.values) if self.is_initialized else 0

    def num_slots(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return hf_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def crop_count(seen: int, tokens_to_remove: int) -> int:
    """Tokens a ``crop(tokens_to_remove)`` removes from ``seen``: ``-n`` removes n, ``m > 0`` keeps the first m,
    0 removes nothing (transformers' assisted decoding calls ``crop(-0)`` when every candidate was accepted)."""
    if tokens_to_remove == 0:
        return 0
    return seen - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove


class SlotStore(StoreMixin, CacheLayerMixin):
    """Tokens held as slots, each with its absolute position.

    Tensors (B batch, H = the store's KV heads, n slots):
      ``keys``/``values`` ``[B, H, n, D]``; ``pos`` ``[B, Hp, n]`` int32 with Hp = 1 (all heads hold the
      same positions) or H; ``pos == -1`` marks padding. Slots are in increasing position order and
      the newest tokens are appended at the end, uncompressed (the *tail*).

    The policy hooks are ``should_compress()``, ``compress()`` (evict / merge the held slots),
    ``on_prefill(query, module)`` (compress after exact prefill attention) and
    ``visible(qpos)`` (extra read mask). Compression only runs at the start of ``update`` (all held
    tokens are then committed) or right after the prefill, never inside a multi-token verification
    step, so ``crop(-n)`` is exact for every n up to the tokens added since the last compression.
    """

    is_sliding = False
    is_croppable = True
    _batch_tensors = ("keys", "values", "pos", "first_pos")

    def __init__(self, info: LayerInfo, num_heads: int | None = None):
        super().__init__()
        self.info = info
        self.num_store_heads = num_heads if num_heads is not None else info.num_kv_heads
        self.seen = 0
        self.pos: torch.Tensor | None = None
        self.first_pos: torch.Tensor | None = None  # [B] first non-padding position of each row
        self.committed = 0  # seen at the last compression: crop may not go below it

    # ---- transformers Cache API -------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Store new tokens ``[B, H, T, D]``; returns them (the attention function reads the store)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys is not None and self.should_compress():
            self.compress()
            self.committed = self.seen
        self.append(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The generic mask stays position-indexed; kvkit only reads its padding information.
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.pos = self.first_pos = None
        self.seen = 0
        self.committed = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` removes the newest n tokens; ``crop(m > 0)`` keeps the first m; ``crop(0)`` is a no-op
        (transformers' assisted decoding calls ``crop(-0)`` when every candidate was accepted)."""
        n = crop_count(self.seen, tokens_to_remove)
        if n <= 0 or self.keys is None:
            return
        floor = self.crop_floor()
        if self.seen - n < floor:
            raise ValueError(
                f"{type(self).__name__} (layer {self.info.layer_idx}) cannot crop {n} tokens exactly: it can only "
                f"go back to {floor} tokens ({self.seen - floor} of the {self.seen} seen), the rest was compressed. "
                "Crop right after the forward that added them (as speculative decoding does)."
            )
        self._drop_last(n)
        self.seen -= n

    def crop_floor(self) -> int:
        """The shortest length ``crop`` can go back to exactly: the last compression point by default."""
        return self.committed

    def _drop_last(self, n: int) -> None:
        self.keys = self.keys[..., :-n, :]
        self.values = self.values[..., :-n, :]
        self.pos = self.pos[..., :-n]

    def _apply_batch(self, fn) -> None:
        for name in self._batch_tensors:
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor):
                setattr(self, name, fn(t))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    # ---- storage -----------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        B, _, T, _ = k.shape
        new_pos = torch.arange(self.seen, self.seen + T, device=k.device, dtype=torch.int32)
        hp = 1 if self.pos is None else self.pos.shape[1]
        new_pos = new_pos.view(1, 1, T).expand(B, hp, T)
        if self.keys is None:
            self.keys, self.values, self.pos = k, v, new_pos.contiguous()
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
            self.pos = torch.cat([self.pos, new_pos], dim=-1)
        self.seen += T

    def mark_padding(self, attention_mask: torch.Tensor | None, T: int) -> None:
        """Read which of the ``T`` newest tokens are padding from the model's mask ``[B, 1, T, kv]``."""
        B = self.keys.shape[0]
        if self.first_pos is None:
            self.first_pos = torch.full((B,), self.seen - T, dtype=torch.int32, device=self.keys.device)
        if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
            return
        valid = attention_mask[:, 0, -1, self.seen - T : self.seen].to(self.keys.device)  # [B, T]
        if bool(valid.all()):
            return
        tail = self.pos[..., -T:]
        self.pos[..., -T:] = torch.where(valid[:, None, :], tail, torch.full_like(tail, -1))
        if self.seen == T:  # prefill: first real token of each row (left padding)
            first = torch.where(valid, torch.arange(T, device=valid.device), T).amin(dim=-1)
            self.first_pos = first.to(torch.int32).to(self.keys.device)

    def keep_slots(self, idx: torch.Tensor) -> None:
        """Keep only slots ``idx [B, Hi, k]`` (Hi = 1 or H; sorted ascending) and drop the rest."""
        H, D = self.keys.shape[1], self.keys.shape[-1]
        kv_idx = idx.expand(idx.shape[0], H, idx.shape[-1]) if idx.shape[1] == 1 else idx
        gidx = kv_idx.unsqueeze(-1).expand(*kv_idx.shape, D)
        self.keys = self.keys.gather(2, gidx)
        self.values = self.values.gather(2, gidx)
        if self.pos.shape[1] == idx.shape[1]:
            self.pos = self.pos.gather(2, idx)
        else:
            self.pos = self.pos.expand(-1, H, -1).gather(2, kv_idx)

    def evict_by_score(self, scores: torch.Tensor, k: int) -> None:
        """Keep the ``k`` best slots per (row, head) by ``scores [B, Hi, n]``; padding always goes first."""
        n = self.keys.shape[-2]
        if k >= n:
            return
        pos = self.pos if self.pos.shape[1] == scores.shape[1] else self.pos.expand(-1, scores.shape[1], -1)
        scores = scores.float().masked_fill(pos < 0, float("-inf"))
        idx = scores.topk(k, dim=-1).indices.sort(dim=-1).values
        self.keep_slots(idx)

    def nbytes(self) -> int:
        return _tensor_bytes(self.keys, self.values, self.pos)

    def num_slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    # ---- policy hooks ------------------------------------------------------------------------
    def should_compress(self) -> bool:
        return False

    def compress(self) -> None:
        pass

    def on_prefill(self, query: torch.Tensor, module) -> None:
        pass

    def visible(self, qpos: torch.Tensor) -> torch.Tensor | None:
        """Extra read mask ``[B, Hp|1, T, n]`` for queries at positions ``qpos [T]`` (None: all held)."""
        return None

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        T = query.shape[2]
        self.mark_padding(attention_mask, T)
        if self.seen == T:
            # Prefill: exact attention over the whole prompt, then compress what is kept.
            out = hf_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            self.on_prefill(query, module)
            self.committed = self.seen
            return out
        qpos = torch.arange(self.seen - T, self.seen, device=query.device, dtype=torch.int32)
        return self.decode(query, qpos, scaling)

    def decode(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """Read the held slots for queries at ``qpos``; returns ``[B, T, Hq, D]``."""
        return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling, self.visible(qpos))


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_infos(model_or_config, rope=None) -> list[LayerInfo]:
    config = getattr(model_or_config, "config", model_or_config)
    tc = _text_config(config)
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
    import inspect

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

    return rope


class KVCache(Cache):
    """A transformers ``Cache`` whose layers are the stores of a kvkit policy.

    ``KVCache(model)`` uses the policy ``kvkit.patch`` installed on the model (``full`` if none);
    ``KVCache(model, "streaming", budget=512)`` builds one for a given policy.
    """

    def __init__(self, model, policy=None, **options):
        from kvkit.registry import get_policy

        if policy is None:
            state = getattr(model, "_kvkit_state", None)
            policy = state.policy if state is not None and not options else "full"
        self.policy = get_policy(policy, **options)
        rope = make_rope_fn(model) if hasattr(model, "named_modules") else None
        self.infos = layer_infos(model, rope)
        self.shared: dict = {}
        for info in self.infos:
            info.shared = self.shared
        layers = []
        for info in self.infos:
            if info.layer_type in ("sliding_attention", "chunked_attention") and info.sliding_window:
                layers.append(SlidingStore(info, sliding_window=info.sliding_window))
            elif info.layer_type == "full_attention":
                layers.append(self.policy.new_layer(info))
            else:
                raise ValueError(
                    f"kvkit does not support attention layers of type {info.layer_type!r} "
                    f"(layer {info.layer_idx}); supported: full_attention, sliding_attention"
                )
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def nbytes(self, per_layer: bool = False):
        """Bytes of KV held on the layers' devices (total, or a list per layer)."""
        sizes = [layer.nbytes() for layer in self.layers]
        return sizes if per_layer else sum(sizes)

    def offloaded_nbytes(self, per_layer: bool = False):
        sizes = [layer.offloaded_nbytes() for layer in self.layers]
        return sizes if per_layer else sum(sizes)

    def read_nbytes(self, per_layer: bool = False):
        """K/V bytes a single-token decode step reads (total, or a list per layer); see
        ``StoreMixin.read_nbytes``. For TidalDecode: the last decode forward's reads."""
        sizes = [layer.read_nbytes() for layer in self.layers]
        return sizes if per_layer else sum(sizes)

    def num_slots(self) -> list[int]:
        return [layer.num_slots() for layer in self.layers]

    def __repr__(self) -> str:
        return f"KVCache(policy={self.policy!r}, seen={self.get_seq_length()}, nbytes={self.nbytes()})"
