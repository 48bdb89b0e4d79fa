"""Static slot stores: :class:`StaticSlots`, the mixin that keeps a :class:`~kvkit.stores.base.SlotStore`'s slots in
fixed-capacity buffers written in place (a single-token decode step then has fixed shapes and compiles whole), and
:func:`static_store`, which makes the static variant of a store class."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvkit.stores.layer import tensor_bytes

#: what a compiled step that runs out of static slots says (its compression events did not run between steps)
OVERFLOW = ("kvkit: a compiled decode step ran out of static slots: compile it through model.get_compiled_call(...) "
            "(what generate uses), which runs the compression events and reservations between compiled steps")


class StaticSlots:
    """Mixin, first base of a :class:`SlotStore` subclass (:func:`static_store`): its slots in static buffers, so a
    single-token decode step has fixed shapes and compiles whole (``torch.compile(fullgraph=True)``, CUDA graphs).

    Buffers (cap = the store's capacity), one per slot tensor: ``keys``/``values`` ``[B, H, cap, D]``, ``pos``
    ``[B, Hp, cap]`` int32 with ``-1`` on every slot not held, the store class's own per-slot tensors
    (``static_slot_tensors``: name -> the value of a free slot, e.g. Chelsea's cluster ``size`` ``[B, H, cap]`` with
    1), and two device counters, ``nslots`` (slots held) and ``seen_t`` (tokens seen). Eager code sees each slot
    tensor as the held prefix ``[:n]`` (views: the policy's code runs unchanged, assigning one writes its buffer in
    place and sets the free slots past it to their free value); under ``torch.compile`` they are the whole buffers
    (``pos = -1`` hides the free slots from :func:`~kvkit.stores.attend.attend_slots`).

    A compiled step (``update`` + ``attend`` while compiling) writes the new tokens at slots ``nslots + arange(T)``
    with positions ``seen_t + arange(T)`` (``index_copy_``; a store's own slot tensors keep their free value there,
    which must be a new token's value), advances both counters, and reads every slot with the
    store's own ``decode`` (queries at ``seen_t - T + arange(T)``): no host read, no branch on a device value, no
    Python int that changes per step (it marks the host copies stale instead). Everything else runs eagerly:
    the prefill, multi-token forwards, crops, and the compression events, which the step wrapper runs between
    compiled steps (:meth:`before_compiled_step`: ``compress_if_due`` as an eager ``update`` would, decided on the
    host copies the wrapper keeps current with :meth:`after_compiled_step`). Compression rewrites the buffers'
    prefix in place (same addresses) and marks the slots it frees ``-1``.

    Capacity: ``slots_bound()`` (the most slots the store ever holds, e.g. ``budget + tail``) when the store bounds
    it, else the least of ``max_length`` / :meth:`ensure_capacity` and the held slots plus ``grow``, rounded up to
    ``grow``. The prefill may hold more for a moment (the whole prompt): the buffers shrink back after its
    compression. An eager forward that needs more room re-allocates (one copy; the next compiled step recompiles).

    A single-token step reads no column of transformers' mask (``get_mask_sizes(1) == (1, 0)``: a fixed shape
    for generate's mask prepared outside the compiled step) and treats its token as real, not padding (decoded
    tokens are); multi-token forwards read the padding of their tokens from the mask, as in an eager store.
    """

    static = True
    is_compileable = True
    compile_refusal = None
    grow = 64  # capacity step of an unbounded store (rounded allocations: few distinct shapes)
    #: slot tensor -> value of a free slot (None: any); :func:`static_store` adds the class's ``static_slot_tensors``
    _free: ClassVar[dict[str, float | None]] = {"keys": None, "values": None, "pos": -1}

    def __init__(self, *args, **kwargs):
        self._buf = dict.fromkeys(self._free)
        #: host copies of the held count, per buffer: a policy assigns keys, values and pos one after the other
        #: (each read of the next one must still see the old length); equal between assignments
        self._len = dict.fromkeys(self._free, 0)
        self._seen = 0  # host copy of seen_t
        self._stale = False  # a compiled step moved the device counters; the host copies lag
        self.nslots = torch.zeros((), dtype=torch.int64)
        self.seen_t = torch.zeros((), dtype=torch.int64)
        self._min_cap = 0
        self.tokens_wanted = 0  # the most tokens seen a caller asked room for (ensure_capacity / max_length)
        super().__init__(*args, **kwargs)
        info = self.info
        if info.max_length:
            self.ensure_capacity(info.max_length)

    # ---- host copies -------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self._stale:  # one synchronisation: after compiled steps that no step wrapper followed
            n, self._seen, self._stale = int(self.nslots), int(self.seen_t), False
            self._len = dict.fromkeys(self._len, n)

    def held(self) -> int:
        """Slots held (host)."""
        self._sync()
        return self._len["keys"]

    @property
    def seen(self):
        """Tokens seen: an int; the device counter ``seen_t`` under ``torch.compile``."""
        if torch.compiler.is_compiling():
            return self.seen_t
        self._sync()
        return self._seen

    @seen.setter
    def seen(self, value) -> None:
        self._sync()
        self._seen = int(value)
        self.seen_t.fill_(self._seen)

    # ---- the slot tensors ----------------------------------------------------------------------------------
    def _view(self, name: str):
        buf = self._buf[name]
        if buf is None or torch.compiler.is_compiling():
            return buf
        self._sync()
        return buf[:, :, : self._len[name]]

    keys = property(lambda self: self._view("keys"), lambda self, value: self._set("keys", value))
    values = property(lambda self: self._view("values"), lambda self, value: self._set("values", value))
    pos = property(lambda self: self._view("pos"), lambda self, value: self._set("pos", value))

    def _buffers(self) -> list[torch.Tensor]:
        return [b for b in self._buf.values() if b is not None]

    def cap(self) -> int:
        bufs = self._buffers()
        return bufs[0].shape[2] if bufs else 0

    def _cap_for(self, m: int) -> int:
        """Capacity for ``m`` held slots: the bound, else ``m + grow`` (at least the requested capacity, at least
        twice the current one when growing: few re-allocations, each a recompile), rounded up to ``grow``."""
        bound = self.slots_bound()
        if bound is not None and m <= bound:
            return bound
        need = max(m + self.grow, self._min_cap, 2 * self.cap() if m > self.cap() > 0 else 0)
        return -(-need // self.grow) * self.grow

    def ensure_capacity(self, n: int) -> None:
        """Room for ``n`` tokens seen (an unbounded store holds all of them) without re-allocating."""
        bound = self.slots_bound()
        self.tokens_wanted = max(self.tokens_wanted, n)  # read by stores that size other parts by it
        self._min_cap = max(self._min_cap, n if bound is None else min(n, bound))
        if self._buf["keys"] is not None and self.cap() < self._min_cap:
            self._resize(self._cap_for(self.held()))

    def _resize(self, cap: int) -> None:
        """Re-allocate every buffer with ``cap`` slots, keeping the held prefix (eager)."""
        self._sync()
        for name, buf in self._buf.items():
            if buf is None:
                continue
            n = min(self._len[name], cap)
            new = buf.new_full((*buf.shape[:2], cap, *buf.shape[3:]), self._free[name] or 0)
            new[:, :, :n].copy_(buf[:, :, :n])
            self._buf[name] = new
        self._mark_static()

    def _mark_static(self) -> None:
        if not torch.compiler.is_compiling():  # fixed addresses for CUDA graphs (as transformers' StaticLayer)
            for t in (*self._buffers(), self.nslots, self.seen_t):
                torch._dynamo.mark_static_address(t)

    def _set(self, name: str, value) -> None:
        """``<slot tensor> = value`` (``[B, H|Hp, m, ...]``): written into its buffer's first m slots in place; m
        becomes the held count; the slots past m take their free value (when it matters). None drops the buffer.
        Eager only."""
        if value is None:
            self._buf[name] = None
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(f"{type(self).__name__}: a compiled step cannot reassign its slots")
        m = value.shape[2]
        bufs = self._buffers()
        if bufs and m > self.cap():
            self._resize(self._cap_for(m))
        cap = self.cap() if bufs else self._cap_for(m)
        buf, free = self._buf[name], self._free[name]
        if (buf is None or buf.shape[:2] != value.shape[:2] or buf.shape[3:] != value.shape[3:]
                or buf.dtype != value.dtype or buf.device != value.device):
            buf = value.new_full((*value.shape[:2], cap, *value.shape[3:]), free or 0)
            self._buf[name] = buf
            self._mark_static()
        dst = buf[:, :, :m]
        if not (dst.data_ptr() == value.data_ptr() and dst.stride() == value.stride()):
            dst.copy_(value)
        if free is not None:
            buf[:, :, m:].fill_(free)
        self._len[name] = m
        self.nslots.fill_(m)

    # ---- transformers Cache API ----------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.nslots = self.nslots.to(key_states.device)
        self.seen_t = self.seen_t.to(key_states.device)

    def get_seq_length(self):
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1:
            return 1, 0
        return self.seen + query_length, 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return super().update(key_states, value_states, *args, **kwargs)
        self._write(key_states, value_states)
        self._stale = True
        return key_states, value_states

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Device-only append of ``[B, H, T, D]`` at slots ``nslots + arange(T)``, positions ``seen_t + arange(T)``."""
        B, _, T, _ = k.shape
        kb, vb, pb = self._buf["keys"], self._buf["values"], self._buf["pos"]
        if torch.compiler.is_compiling():  # a device-side check: no host read
            torch._assert_async(self.nslots + T <= kb.shape[2], OVERFLOW)
        ar = torch.arange(T, device=self.nslots.device)
        idx = self.nslots + ar
        kb.index_copy_(2, idx, k)
        vb.index_copy_(2, idx, v)
        p = (self.seen_t + ar).to(torch.int32).view(1, 1, T).expand(B, pb.shape[1], T)
        pb.index_copy_(2, idx, p)
        self.nslots.add_(T)
        self.seen_t.add_(T)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._buf["keys"] is None:
            super().append(k, v)  # the first tokens: the setters allocate
            return
        T = k.shape[2]
        n, seen = self.held(), self._seen
        if n + T > self.cap():
            self._resize(self._cap_for(n + T))
        self._write(k, v)
        self._len = dict.fromkeys(self._len, n + T)
        self._seen = seen + T
        self.appended(T)

    def mark_padding(self, attention_mask, T: int) -> None:
        if T == 1:  # a decoded token is real; the mask's single column is not read (see the class docstring)
            kb = self._buf["keys"]
            if self.first_pos is None:
                self.first_pos = torch.full((kb.shape[0],), self.seen - T, dtype=torch.int32, device=kb.device)
            self.step_masked = attention_mask is not None
            return
        super().mark_padding(attention_mask, T)

    def dense_decode(self, T: int) -> bool:
        return False if torch.compiler.is_compiling() else super().dense_decode(T)

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        T = query.shape[2]
        if not torch.compiler.is_compiling():
            prefill = self.seen == T
            out = super().attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            if prefill:  # the prompt is compressed: back to the store's own capacity
                self._fit()
            return out
        self.record_queries(query)
        qpos = (self.seen_t - T + torch.arange(T, device=query.device)).to(torch.int32)
        return self.decode(query, qpos, scaling)

    def _fit(self) -> None:
        want = self._cap_for(self.held())
        if self.cap() > want and self.slots_bound() is not None:
            self._resize(want)

    def compress_if_due(self) -> None:
        super().compress_if_due()
        self._fit()  # after an eager forward that outgrew the bound (a speculative round), back to it

    # ---- compiled steps -------------------------------------------------------------------------------------
    def before_compiled_step(self, T: int) -> None:
        self._sync()
        if self._buf["keys"] is None:
            raise RuntimeError(f"{type(self).__name__} (layer {self.info.layer_idx}): a static cache is filled by an "
                               "eager forward (the prefill) before any compiled step")
        self.compress_if_due()
        if self.held() + T > self.cap():
            self._resize(self._cap_for(self.held() + T))
        self._step_from = (self.held(), self._seen)

    def after_compiled_step(self, T: int) -> None:
        n, seen = self._step_from
        self._len = dict.fromkeys(self._len, n + T)
        self._seen, self._stale = seen + T, False
        self.appended(T)

    # ---- the rest of the Cache API ---------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self._len = dict.fromkeys(self._len, 0)
        self._seen = 0
        self._stale = False
        self.nslots.zero_()
        self.seen_t.zero_()

    def allocated_nbytes(self) -> int:
        return tensor_bytes(*self._buffers()) + self.off_slot_nbytes()

    def free_slot_nbytes(self) -> int:
        """Bytes of the buffers' slots past the held ones: a compiled step reads them too (masked, fixed shapes)."""
        self._sync()
        return sum(b[:, :, self._len[name]:].numel() * b.element_size() for name, b in self._buf.items()
                   if b is not None)


_STATIC_CLASSES: dict = {}


def static_store(cls):
    """The static variant of a :class:`~kvkit.stores.base.SlotStore` subclass: ``class Static<Name>(StaticSlots,
    cls)`` (made once), its ``static_slot_tensors`` (name -> a free slot's value) in static buffers too. Policies
    build it when ``info.static``; the class must keep its decode path free of host reads."""
    if cls not in _STATIC_CLASSES:
        extra = dict(getattr(cls, "static_slot_tensors", {}))
        ns = {"__module__": cls.__module__, "__doc__": StaticSlots.__doc__, "_free": {**StaticSlots._free, **extra}}
        for name in extra:
            ns[name] = property(lambda self, n=name: self._view(n), lambda self, value, n=name: self._set(n, value))
        _STATIC_CLASSES[cls] = type(f"Static{cls.__name__}", (StaticSlots, cls), ns)
    return _STATIC_CLASSES[cls]
