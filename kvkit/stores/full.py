"""Uncompressed layers: ``FullStore`` (the ``full`` policy and every exact layer), ``StaticFullStore`` (the same in
static buffers, for a compiled decode step) and ``SlidingStore`` (layers the model itself runs with a sliding window)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvkit.model_info import LayerInfo
from kvkit.stores.attend import (
    attend_static,
    causal_suffix_attention,
    folded_masked_attention,
    hf_sdpa,
    plain_sdpa_call,
    seam_decode,
)
from kvkit.stores.buffers import crop_count, grow_in_place
from kvkit.stores.layer import StoreMixin, tensor_bytes


class FullStore(StoreMixin, DynamicLayer):
    """No compression: exactly transformers' ``DynamicLayer`` (bit-identical attention), plus accounting.

    Between ``set_verifying(True)`` and ``set_verifying(False)`` (:func:`kvkit.speculative`'s verification
    forwards only) multi-token forwards use :func:`kvkit.stores.attend.causal_suffix_attention` (same math, not
    the same bits).
    """

    suffix_attention = False
    headroom = 64  # slots allocated past the held tokens, so decoding does not copy the whole KV every step
    compile_refusal = "its buffers grow and its reads change shape as tokens arrive (static=True: StaticFullStore)"

    def __init__(self, info: LayerInfo, **kwargs):
        super().__init__(**kwargs)
        self.info = info
        self._bufs: dict = {}  # append buffers (grow_in_place)

    def update(self, key_states, value_states, *args, **kwargs):
        """Append into preallocated storage: same values as ``DynamicLayer``'s ``torch.cat``, but the held K/V
        are a prefix view of a buffer with ``headroom`` free slots, re-allocated (one copy) only when full,
        instead of a copy of the whole layer at every decode step (compared with transformers' DynamicCache by
        ``kvkit speculate --baselines dynamic``, results/speculative).
        Crops shrink the view; the next update writes over the cropped slots. Anything that replaced
        ``keys`` (beam reordering, offloading) is detected and copied into a fresh buffer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        cur_k = self.keys if n else key_states[:, :, :0]
        cur_v = self.values if n else value_states[:, :, :0]
        self.keys = grow_in_place(self._bufs, "keys", cur_k, key_states, self.headroom)
        self.values = grow_in_place(self._bufs, "values", cur_v, value_states, self.headroom)
        return self.keys, self.values

    def reset(self) -> None:
        self._bufs = {}
        super().reset()

    def set_verifying(self, on: bool) -> None:
        self.suffix_attention = bool(on)

    def crop(self, tokens_to_remove: int) -> None:
        """Same rule as every kvkit store (:func:`kvkit.stores.crop_count`): ``-n`` removes n, ``m > 0`` keeps m."""
        self.rollback(crop_count(self.get_seq_length(), tokens_to_remove))

    def rollback(self, n: int, ends_round: bool = True) -> None:
        if n > 0 and self.is_initialized:
            self.keys = self.keys[..., :-n, :]
            self.values = self.values[..., :-n, :]

    def allocated_nbytes(self) -> int:
        """Bytes of the buffers, headroom included (``nbytes`` counts the held tokens only)."""
        return tensor_bytes(*self._bufs.values()) if self._bufs else self.nbytes()

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values) if self.is_initialized else 0

    def num_slots(self) -> int:
        return self.get_seq_length()

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if self.suffix_attention and not dropout and plain_sdpa_call(kwargs):
            out = causal_suffix_attention(query, key, value, attention_mask, scaling)
            if out is None:  # rows not aligned (padding, holes): the mask as given, K/V read once per K/V head
                out = folded_masked_attention(query, key, value, attention_mask, scaling)
            if out is not None:
                return out
        if not dropout and plain_sdpa_call(kwargs) and query.shape[2] == 1:  # one decode query: the seam
            m = attention_mask
            if m is None:
                r = seam_decode(query, key, value, scaling)
            elif m.dtype == torch.bool and m.dim() == 4 and m.shape[1] == 1 and m.shape[-1] == key.shape[2]:
                # padding columns hidden by a -inf log-weight ([B, 1, n]: one row per batch row, every head)
                lw = torch.zeros(m.shape[0], 1, m.shape[-1], device=key.device).masked_fill_(~m[:, :, -1], float("-inf"))
                r = seam_decode(query, key, value, scaling, log_weight=lw)
            else:
                r = None
            if r is not None:
                return r[0]
        return hf_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


class SlidingStore(StoreMixin, DynamicSlidingWindowLayer):
    """A layer the model itself runs with a sliding window (Mistral, Gemma 2/3 local layers).

    Policies leave these layers to the model's own window: they are already bounded.
    """

    compile_refusal = ("a layer the model runs with its own sliding window: kvkit has no static sliding store yet, "
                       "so a model with sliding-window layers (Mistral with sliding_window, Gemma 2/3) gets no "
                       "static cache")

    def __init__(self, info: LayerInfo, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.info = info

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values) if self.is_initialized else 0

    def num_slots(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return hf_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    def check_rollback(self, n: int) -> None:
        """Raise ``ValueError`` where transformers' sliding layer would refuse ``crop(-n)`` (nothing changes)."""
        seen = self.get_seq_length()
        if n > seen:
            raise ValueError(f"cannot crop {n} tokens: the sliding layer {self.info.layer_idx} has seen only {seen}")
        if n > 0 and seen >= self.sliding_window and not getattr(self, "record_past", False):
            raise ValueError(
                f"sliding layer {self.info.layer_idx} has reached its window ({self.sliding_window}) and does not record "
                "past states, so it cannot roll back; call `activate_past_recording()` on the cache's sliding layers first"
            )

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            self.rollback(crop_count(self.get_seq_length(), tokens_to_remove))
        else:
            self.rollback(-tokens_to_remove)

    def rollback(self, n: int, ends_round: bool = True) -> None:
        self.check_rollback(n)
        DynamicSlidingWindowLayer.crop(self, -n)


#: what a compiled step past a static full layer's capacity says
OVERFLOW = ("kvkit: a compiled decode step ran past the static cache's capacity: give it room before compiled steps "
            "(kvkit.patch(..., static=True, max_length=N), cache.ensure_capacity(N), or decode through "
            "model.generate / model.get_compiled_call(...), which make room between steps)")


class StaticFullStore(FullStore):
    """No compression, in static buffers: the ``full`` layer of a ``static`` cache (``kvkit.patch(..., static=True)``),
    whose decode step has fixed shapes, so ``torch.compile(fullgraph=True)`` / CUDA graphs capture it
    (``is_compileable``; transformers' ``generate`` then compiles the decode forward itself on CUDA).

    Buffers ``kbuf``/``vbuf`` ``[B, H, cap, D]`` are allocated (zeros) at the first update with a capacity ``cap`` of
    at least ``capacity`` (the cache's ``max_length``, or what :meth:`ensure_capacity` asked for) and at least the
    prompt plus ``grow`` slots, rounded up to a multiple of ``grow``; an eager forward that would overflow them
    re-allocates (one copy, ``grow`` free slots, rounded) before writing. A compiled step never re-allocates:
    capacity is fixed up front (``generate`` sizes it to prompt + ``max_new_tokens``); an overflowing compiled step
    fails in ``index_copy_``.

    Per step: the new tokens ``[B, H, T, D]`` are written in place at slots ``length + arange(T)``, where
    ``length`` is a 0-d int64 device tensor (tokens held), then ``length += T``; ``update`` returns the whole
    buffers and ``get_mask_sizes`` says ``(cap, 0)``, so transformers' mask ``[B, 1, T, cap]`` hides the slots not
    yet written (exactly as its ``StaticLayer``). No Python int that changes per step enters a compiled step: under
    ``torch.compile`` ``get_seq_length`` is the device ``length``.

    Eager forwards keep a host copy ``_n`` of ``length`` (no synchronisation) and read only the held prefix
    ``[:n]`` (and the mask's first ``n`` columns) with :class:`FullStore`'s attention, so an eager decode step reads
    ``n`` slots, not ``cap``; ``keys``/``values`` are that prefix view. A compiled step cannot update ``_n`` (it
    would be a guard that changes every step): it marks it stale, and the next eager use reads ``length`` once
    (one synchronisation, outside steps).

    The compiled read is :func:`kvkit.stores.attend.attend_static`: the query heads of each KV head folded into one
    block over the whole capacity under the mask. Crop / rollback move ``length`` back (the slots are overwritten
    by the next write): exact at any length.
    """

    is_compileable = True
    compile_refusal = None
    grow = 256  # capacity step: allocations round up to a multiple of it (few distinct shapes, few recompiles)

    def __init__(self, info: LayerInfo, capacity: int | None = None, **kwargs):
        self.kbuf = self.vbuf = None
        self.length = torch.zeros((), dtype=torch.int64)  # tokens held (device counter)
        self._n: int | None = 0  # host copy of length; None after compiled steps (stale)
        self.capacity = capacity or 0  # the least capacity to allocate
        super().__init__(info, **kwargs)

    # ---- keys / values: the held prefix (transformers' and kvkit's readers of ``layer.keys``) ---------------
    @property
    def keys(self):
        return None if self.kbuf is None else self.kbuf[:, :, : self.host_length()]

    @keys.setter
    def keys(self, value):  # CacheLayerMixin.__init__ / DynamicLayer.reset write None; nothing else may
        if value is not None:
            raise AttributeError("StaticFullStore.keys is a view of its buffers; write through update()")

    @property
    def values(self):
        return None if self.vbuf is None else self.vbuf[:, :, : self.host_length()]

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("StaticFullStore.values is a view of its buffers; write through update()")

    def host_length(self) -> int:
        """Tokens held, as a Python int (one synchronisation after compiled steps, none otherwise)."""
        if self._n is None:
            self._n = int(self.length)
        return self._n

    def cap(self) -> int:
        return 0 if self.kbuf is None else self.kbuf.shape[2]

    def _round(self, need: int) -> int:
        """Capacity for ``need`` tokens: at least ``capacity``, at least twice the current one when growing (few
        re-allocations, each a recompile of a compiled step), rounded up to ``grow``."""
        need = max(need, self.capacity, 2 * self.cap() if need > self.cap() > 0 else 0)
        return -(-need // self.grow) * self.grow

    def ensure_capacity(self, n: int) -> None:
        """Make room for ``n`` tokens in all (held + future) before a compiled loop: allocates or re-allocates now
        if the buffers are smaller (eager; one copy), else remembers it for the first allocation."""
        self.capacity = max(self.capacity, n)
        if self.kbuf is not None and self.cap() < n:
            self._allocate(self.kbuf.shape[0], self.kbuf.shape[1], self.kbuf.shape[3], self.vbuf.shape[3],
                           self.kbuf.dtype, self.kbuf.device, n)

    def _allocate(self, B, H, Dk, Dv, dtype, device, need: int) -> None:
        cap = self._round(need)
        kb = torch.zeros((B, H, cap, Dk), dtype=dtype, device=device)
        vb = torch.zeros((B, H, cap, Dv), dtype=dtype, device=device)
        n = self.host_length() if self.kbuf is not None else 0
        if n:
            kb[:, :, :n].copy_(self.kbuf[:, :, :n])
            vb[:, :, :n].copy_(self.vbuf[:, :, :n])
        self.kbuf, self.vbuf = kb, vb
        self.length = self.length.to(device)
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs replay them (as transformers' StaticLayer)
            for t in (self.kbuf, self.vbuf, self.length):
                torch._dynamo.mark_static_address(t)

    # ---- transformers Cache API ---------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Write ``[B, H, T, D]`` at slots ``length .. length + T - 1``; returns the whole buffers ``[B, H, cap, D]``."""
        T = key_states.shape[-2]
        if not torch.compiler.is_compiling():
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.host_length()
            if self.kbuf is None or n + T > self.cap() or self.kbuf.shape[0] != key_states.shape[0]:
                self._allocate(*key_states.shape[:2], key_states.shape[3], value_states.shape[3], key_states.dtype,
                               key_states.device, n + T + (self.grow if self.kbuf is not None else 0))
            self._n = n + T
        else:
            self._n = None  # the compiled step cannot keep the host copy: the next eager use reads `length`
            torch._assert_async(self.length + T <= self.kbuf.shape[2], OVERFLOW)  # device-side: no host read
        idx = torch.arange(T, device=self.length.device) + self.length
        self.kbuf.index_copy_(2, idx, key_states.to(self.kbuf.dtype))
        self.vbuf.index_copy_(2, idx, value_states.to(self.vbuf.dtype))
        self.length.add_(T)
        return self.kbuf, self.vbuf

    def before_compiled_step(self, T: int) -> None:
        n = self.host_length()
        if self.kbuf is not None and n + T > self.cap():  # eager growth (the compiled step then recompiles)
            self._allocate(self.kbuf.shape[0], self.kbuf.shape[1], self.kbuf.shape[3], self.vbuf.shape[3],
                           self.kbuf.dtype, self.kbuf.device, n + T + self.grow)
        self._step_from = n

    def after_compiled_step(self, T: int) -> None:
        self._n = self._step_from + T

    def get_seq_length(self):
        """Tokens seen: the device ``length`` under ``torch.compile`` (as transformers' ``StaticLayer``), else an int."""
        if torch.compiler.is_compiling():
            return self.length
        return self.host_length() if self.kbuf is not None else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(cap, 0)``: the mask spans the buffers (the capacity the coming update will have when it grows)."""
        if torch.compiler.is_compiling():
            return self.cap(), 0
        n = self.get_seq_length()
        if self.kbuf is not None and n + query_length <= self.cap():
            return self.cap(), 0
        return self._round(n + query_length + (self.grow if self.kbuf is not None else 0)), 0

    def get_max_length(self) -> int:
        return self.cap() if self.kbuf is not None else -1

    def reset(self) -> None:
        """Forget the held tokens, keep the buffers (same addresses for a compiled step)."""
        self.length.zero_()
        self._n = 0

    def rollback(self, n: int, ends_round: bool = True) -> None:
        held = self.get_seq_length()
        if n > held:
            raise ValueError(f"cannot crop {n} tokens: layer {self.info.layer_idx} has seen only {held}")
        if n > 0:
            self.length.sub_(n)
            self._n = held - n

    def _rebatch(self, fn) -> None:
        if self.kbuf is not None:
            self.kbuf, self.vbuf = fn(self.kbuf), fn(self.vbuf)
            for t in (self.kbuf, self.vbuf):
                torch._dynamo.mark_static_address(t)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.kbuf is not None:  # in place: same addresses
            idx = beam_idx.to(self.kbuf.device)
            self.kbuf.copy_(self.kbuf.index_select(0, idx))
            self.vbuf.copy_(self.vbuf.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebatch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebatch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices].contiguous())

    # ---- accounting -------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values) if self.kbuf is not None else 0

    def allocated_nbytes(self) -> int:
        return tensor_bytes(self.kbuf, self.vbuf)

    def num_slots(self) -> int:
        return self.get_seq_length()

    # ---- attention ----------------------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """Compiled: the whole buffers under the mask (:func:`attend_static`). Eager: :class:`FullStore`'s attention
        over the held prefix (``key``/``value`` are the buffers ``update`` returned; the mask's first n columns)."""
        if torch.compiler.is_compiling():
            return attend_static(module, query, key, value, attention_mask, self.length, scaling, dropout, **kwargs)
        n = self.host_length()
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = attention_mask[..., :n]
        return super().attend(module, query, key[:, :, :n], value[:, :, :n], attention_mask, scaling, dropout,
                              **kwargs)
