"""The store layer under the policies: ``LayerInfo`` (what a store knows about its layer; defined in
:mod:`kvkit.model_info`, which builds it from the config), ``StoreMixin``
(what every kvkit layer adds to transformers' ``CacheLayerMixin``) and ``SlotStore`` (tokens held as slots
with their absolute positions). Stores import kernels, never policies."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvkit.compat import CacheLayerCompat
from kvkit.model_info import LayerInfo  # noqa: F401  (re-exported: stores build on it)
from kvkit.stores.attend import attend_slots, hf_sdpa


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class StoreMixin(CacheLayerCompat):
    """What every kvkit layer store adds to transformers' ``CacheLayerMixin``."""

    info: LayerInfo
    #: why a decode step over this store cannot be compiled whole (``is_compileable`` False); None when it can
    compile_refusal: str | None = "its buffers and its read change shape as tokens arrive (no static variant)"

    def nbytes(self) -> int:
        """Bytes of KV data (and slot metadata) this layer holds on its device."""
        raise NotImplementedError

    def offloaded_nbytes(self) -> int:
        """Bytes this layer keeps off-device (e.g. ShadowKV's value store)."""
        return 0

    def allocated_nbytes(self) -> int:
        """Bytes allocated on the device, free append headroom included (``nbytes`` counts held data only)."""
        return self.nbytes()

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

    # ---- the rollback API (kvkit.speculative and transformers' assisted decoding use only this) ----------
    #: True when ``update`` returns only the new tokens, so transformers' own attention would read a wrong KV:
    #: such a store must only run behind kvkit's registered attention (``kvkit.patch``)
    needs_kvkit_attention = False

    def crop_floor(self) -> int:
        """The shortest length ``crop``/``rollback`` can go back to exactly (0: any)."""
        return 0

    def rollback(self, n: int, ends_round: bool = True) -> None:
        """Remove the newest ``n`` tokens exactly (``ValueError`` below ``crop_floor``). ``ends_round``: this
        rollback closes a speculative round (False for rollbacks inside a round, e.g. an assistant's)."""
        raise NotImplementedError

    def reserve(self, n: int) -> None:
        """Compress now if adding ``n`` tokens would trigger a compression, so the next ``n`` tokens stay exactly
        croppable (called before a speculative round)."""

    def check_rollback(self, n: int) -> None:
        """Raise ``ValueError`` if ``rollback(n)`` cannot be exact (nothing changes)."""
        if n > self.get_seq_length():
            raise ValueError(f"cannot crop {n} tokens: layer {self.info.layer_idx} has seen only {self.get_seq_length()}")

    def set_verifying(self, on: bool) -> None:
        """Multi-token forwards between ``set_verifying(True)`` and ``(False)`` are speculative verifications
        (causal over the cache, no padding); stores may take a faster exact path for them."""

    # ---- compiled steps (static stores; ``KVCache.before_compiled_step``) ------------------------------------
    def before_compiled_step(self, T: int) -> None:
        """Eager, right before a compiled forward of ``T`` new tokens: what the compiled step cannot do (a due
        compression event, room for ``T`` more tokens). Default: nothing."""

    def after_compiled_step(self, T: int) -> None:
        """Eager, right after that compiled forward: bring the host copies of the lengths forward by ``T`` (the
        compiled step only moved the device counters). Default: nothing."""


def grow_in_place(bufs: dict, name: str, cur: torch.Tensor, new: torch.Tensor, headroom: int) -> torch.Tensor:
    """``cat([cur, new], dim=2)`` written in place into the preallocated buffer ``bufs[name]`` of which ``cur`` is a
    prefix view; re-allocated (one copy, ``headroom`` free slots) only when full or when ``cur`` is no longer that
    view (after an eviction, a beam reorder, a deepcopy). Crops shrink the view; the next append writes over the
    cropped slots. Used by every store that appends (``SlotStore``, ``FullStore``)."""
    buf = bufs.get(name)
    n, t = cur.shape[2], new.shape[2]
    if not (buf is not None and cur.data_ptr() == buf.data_ptr() and cur.stride() == buf.stride()
            and cur.shape[:2] == buf.shape[:2] and cur.shape[3:] == buf.shape[3:] and new.shape[:2] == cur.shape[:2]
            and n + t <= buf.shape[2] and buf.dtype == new.dtype and buf.device == new.device):
        buf = new.new_empty((*new.shape[:2], n + t + headroom, *new.shape[3:]))
        buf[:, :, :n].copy_(cur)
        bufs[name] = buf
    buf[:, :, n : n + t].copy_(new)
    return buf[:, :, : n + t]


def crop_count(seen: int, tokens_to_remove: int) -> int:
    """Tokens a ``crop(tokens_to_remove)`` removes from ``seen``: ``-n`` removes n, ``m > 0`` keeps the first m
    (nothing when ``m >= seen``), 0 removes nothing (transformers' assisted decoding calls ``crop(-0)`` when every
    candidate was accepted). Removing more tokens than were seen raises ``ValueError``; the same rule holds for
    every store, ``full`` included."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise ValueError(f"crop takes an integer, got {tokens_to_remove!r}")
    if tokens_to_remove == 0:
        return 0
    if tokens_to_remove > 0:
        return max(seen - tokens_to_remove, 0)
    if -tokens_to_remove > seen:
        raise ValueError(f"cannot crop {-tokens_to_remove} tokens: the cache has seen only {seen}")
    return -tokens_to_remove


def new_ring(B: int, H: int, size: int, D: int, dtype, device):
    """An empty query ring ``([B, H, size, D] zeros, [size] -1)``, at fixed addresses for CUDA graphs."""
    buf = torch.zeros(B, H, size, D, dtype=dtype, device=device)
    buf_pos = torch.full((size,), -1, dtype=torch.int64, device=device)
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(buf)
        torch._dynamo.mark_static_address(buf_pos)
    return buf, buf_pos


def ring_write(buf, buf_pos, q: torch.Tensor, first: torch.Tensor, size: int):
    """Write queries ``q [B, Hq, T, D]`` at positions ``first + arange(T)`` (``first`` a 0-d device tensor) into a
    ring of ``size`` slots (slot = position % size; the last ``size`` of them when T is larger), allocating it when
    ``buf`` is None or of another batch size. Returns ``(buf [B, Hq, size, D], buf_pos [size] int64, -1 = empty)``.
    In place, no host read: what a static store's compiled step records (observation windows)."""
    if q.shape[2] > size:
        first = first + (q.shape[2] - size)
        q = q[:, :, -size:]
    if buf is None or buf.shape[0] != q.shape[0]:
        buf, buf_pos = new_ring(q.shape[0], q.shape[1], size, q.shape[3], q.dtype, q.device)
    qp = first + torch.arange(q.shape[2], device=q.device)
    slot = qp % size
    buf.index_copy_(2, slot, q)
    buf_pos.index_copy_(0, slot, qp)
    return buf, buf_pos


def ring_last(buf, buf_pos, k: int, seen: int):
    """The ring's queries at the last ``k`` positions before ``seen``, in position order: ``(q [B, Hq, k', D],
    qpos [k'] int32)`` with k' = min(k, size); a slot holding none of them reads position -1 (it sees no key)."""
    order = buf_pos.argsort()[-k:]
    qpos = buf_pos[order]
    qpos = torch.where(qpos >= seen - k, qpos, -1).to(torch.int32)
    return buf[:, :, order], qpos


class SeenLength:
    """transformers' length API for stores that count the tokens they have *seen* (``self.seen``), whatever they
    hold: position ids stay right after eviction; the generic mask stays position-indexed (kvkit reads only its
    padding information)."""

    seen: int

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1


class SlotStore(SeenLength, StoreMixin, CacheLayerMixin):
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
    needs_kvkit_attention = True
    static = False  # StaticSlots: the slots live in static buffers
    _batch_tensors = ("keys", "values", "pos", "first_pos")

    def __init__(self, info: LayerInfo, num_heads: int | None = None):
        super().__init__()
        self.info = info
        self.num_store_heads = num_heads if num_heads is not None else info.num_kv_heads
        self.seen = 0
        self.pos: torch.Tensor | None = None
        self.first_pos: torch.Tensor | None = None  # [B] first non-padding position of each row
        self.committed = 0  # seen at the last compression: crop may not go below it
        #: some held slot may be unreadable (padding, a retired slot: ``pos < 0``); a Python flag updated at
        #: prefill, multi-token forwards and compression events (which may synchronise), read by decode steps
        #: (which may not) to choose the unmasked single-query path
        self.has_dead = False
        #: the current forward carries a padding mask (transformers passes None when no row has padding)
        self.step_masked = False

    # ---- transformers Cache API -------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Store new tokens ``[B, H, T, D]``; returns them (the attention function reads the store)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.compress_if_due()
        self.append(key_states, value_states)
        return key_states, value_states

    def compress_if_due(self) -> None:
        """The compression event at the start of an update (all held tokens committed), when ``should_compress``."""
        if self.keys is not None and self.should_compress():
            self.compress()
            self.committed = self.seen
            self.refresh_dead()

    def reset(self) -> None:
        self.__dict__.pop("_bufs", None)
        self.keys = self.values = self.pos = self.first_pos = None
        self.seen = 0
        self.committed = 0
        self.has_dead = self.step_masked = False
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' API: ``crop(-n)`` removes the newest n tokens; ``crop(m > 0)`` keeps the first m;
        ``crop(0)`` is a no-op (see :func:`crop_count`). Every crop ends a speculative round."""
        self.rollback(crop_count(self.seen, tokens_to_remove))

    def check_rollback(self, n: int) -> None:
        """Raise ``ValueError`` if ``rollback(n)`` cannot be exact (nothing changes)."""
        super().check_rollback(n)
        floor = self.crop_floor()
        if n > 0 and self.keys is not None and self.seen - n < floor:
            raise ValueError(
                f"{type(self).__name__} (layer {self.info.layer_idx}) cannot crop {n} tokens exactly: it can only "
                f"go back to {floor} tokens ({self.seen - floor} of the {self.seen} seen), the rest was compressed. "
                "Crop right after the forward that added them (as speculative decoding does)."
            )

    def rollback(self, n: int, ends_round: bool = True) -> None:
        self.check_rollback(n)
        if n > 0 and self.keys is not None:
            self._drop_last(n)
            self.seen -= n
        if ends_round:
            self.on_round_end()

    def on_round_end(self) -> None:
        """Hook: a rollback closed a speculative round (StreamingLLM compresses early at the next update)."""

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
        """Append ``T`` new tokens ``[B, H, T, D]`` at the end (positions ``seen .. seen + T - 1``)."""
        B, _, T, _ = k.shape
        new_pos = torch.arange(self.seen, self.seen + T, device=k.device, dtype=torch.int32)
        hp = 1 if self.pos is None else self.pos.shape[1]
        new_pos = new_pos.view(1, 1, T).expand(B, hp, T)
        if self.keys is None:
            self.keys, self.values, self.pos = k, v, new_pos.contiguous()
        else:
            self.keys = self._grow("keys", self.keys, k)
            self.values = self._grow("values", self.values, v)
            self.pos = self._grow("pos", self.pos, new_pos)
        self.seen += T
        self.appended(T)

    def appended(self, T: int) -> None:
        """Hook: ``T`` tokens were appended (eagerly, or by a compiled step: called after it)."""

    headroom = 64  # slots allocated past the held ones, so decoding does not copy the whole layer every step

    def _grow(self, name: str, cur: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return grow_in_place(self.__dict__.setdefault("_bufs", {}), name, cur, new, self.headroom)

    def mark_padding(self, attention_mask: torch.Tensor | None, T: int) -> None:
        """Read which of the ``T`` newest tokens are padding from the model's mask ``[B, 1, T, kv]`` (their
        positions become -1). A single-token step writes the mask into ``pos`` without reading it on the host;
        a prefill or multi-token forward also updates :attr:`has_dead` (one synchronisation)."""
        B = self.keys.shape[0]
        if self.first_pos is None:
            self.first_pos = torch.full((B,), self.seen - T, dtype=torch.int32, device=self.keys.device)
        self.step_masked = attention_mask is not None
        if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
            return
        valid = attention_mask[:, 0, -1, self.seen - T : self.seen].to(self.keys.device)  # [B, T]
        tail = self.pos[..., -T:]
        self.pos[..., -T:] = torch.where(valid[:, None, :], tail, torch.full_like(tail, -1))
        if self.seen == T:  # prefill: first real token of each row (left padding)
            first = torch.where(valid, torch.arange(T, device=valid.device), T).amin(dim=-1)
            self.first_pos = first.to(torch.int32).to(self.keys.device)
        if T > 1 and not self.has_dead:
            self.has_dead = not bool(valid.all())

    def refresh_dead(self) -> None:
        """Recompute :attr:`has_dead` from ``pos`` (one synchronisation: compression events and prefill only)."""
        self.has_dead = self.pos is not None and bool((self.pos < 0).any())

    def dense_decode(self, T: int) -> bool:
        """True when a ``T``-token read may skip the mask: one query, no padding mask this step, no dead slot
        held (a single decoded token is the newest position, so every held slot is causally visible)."""
        return T == 1 and not self.step_masked and not self.has_dead

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
        return tensor_bytes(self.keys, self.values, self.pos)

    def allocated_nbytes(self) -> int:
        """``nbytes`` plus the free headroom of the append buffers."""
        extra = 0
        for name, buf in self.__dict__.get("_bufs", {}).items():
            cur = getattr(self, name, None)
            if cur is not None and cur.data_ptr() == buf.data_ptr():
                extra += (buf.numel() - cur.numel()) * buf.element_size()
        return self.nbytes() + extra

    def num_slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    # ---- policy hooks ------------------------------------------------------------------------
    def should_compress(self) -> bool:
        return False

    def slots_bound(self) -> int | None:
        """The most slots this store holds after a compression event plus the single-token steps before the next
        one (a static store's capacity); None: unbounded (it never evicts)."""
        return None

    def compress(self) -> None:
        pass

    def on_prefill(self, query: torch.Tensor, module) -> None:
        pass

    def visible(self, qpos: torch.Tensor) -> torch.Tensor | None:
        """Extra read mask ``[B, Hp|1, T, n]`` for queries at positions ``qpos [T]`` (None: all held)."""
        return None

    def record_queries(self, query: torch.Tensor) -> None:
        """Hook: the queries ``[B, Hq, T, D]`` of the ``T`` newest tokens, before they read (ScoredStore's
        observation window)."""

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        T = query.shape[2]
        self.mark_padding(attention_mask, T)
        if self.seen == T:
            # Prefill: exact attention over the whole prompt, then compress what is kept.
            out = hf_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            self.on_prefill(query, module)
            self.committed = self.seen
            self.refresh_dead()
            return out
        qpos = torch.arange(self.seen - T, self.seen, device=query.device, dtype=torch.int32)
        return self.decode(query, qpos, scaling)

    def decode(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """Read the held slots for queries at ``qpos``; returns ``[B, T, Hq, D]``."""
        return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling, self.visible(qpos),
                            dense=self.dense_decode(query.shape[2]))


#: what a compiled step that runs out of static slots says (its compression events did not run between steps)
OVERFLOW = ("kvkit: a compiled decode step ran out of static slots: compile it through model.get_compiled_call(...) "
            "(what generate uses), which runs the compression events and reservations between compiled steps")


class StaticSlots:
    """Mixin, first base of a :class:`SlotStore` subclass (:func:`static_store`): its slots in static buffers, so a
    single-token decode step has fixed shapes and compiles whole (``torch.compile(fullgraph=True)``, CUDA graphs).

    Buffers (cap = the store's capacity): ``_kb``/``_vb`` ``[B, H, cap, D]``, ``_pb`` ``[B, Hp, cap]`` int32 with
    ``-1`` on every slot not held, and two device counters, ``nslots`` (slots held) and ``seen_t`` (tokens seen).
    Eager code sees ``keys``/``values``/``pos`` as the held prefix ``[:n]`` (views: the policy's code runs
    unchanged, assigning them writes the buffers in place); under ``torch.compile`` they are the whole buffers
    (``pos = -1`` hides the free slots from :func:`~kvkit.stores.attend.attend_slots`).

    A compiled step (``update`` + ``attend`` while compiling) writes the new tokens at slots ``nslots + arange(T)``
    with positions ``seen_t + arange(T)`` (``index_copy_``), advances both counters, and reads every slot with the
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

    def __init__(self, *args, **kwargs):
        self._kb = self._vb = self._pb = None
        #: host copies of the held count, per buffer: a policy assigns keys, values and pos one after the other
        #: (each read of the next one must still see the old length); equal between assignments
        self._len = {"_kb": 0, "_vb": 0, "_pb": 0}
        self._seen = 0  # host copy of seen_t
        self._stale = False  # a compiled step moved the device counters; the host copies lag
        self.nslots = torch.zeros((), dtype=torch.int64)
        self.seen_t = torch.zeros((), dtype=torch.int64)
        self._min_cap = 0
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
        return self._len["_kb"]

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
    def _view(self, buf, name: str):
        if buf is None or torch.compiler.is_compiling():
            return buf
        self._sync()
        return buf[:, :, : self._len[name]]

    @property
    def keys(self):
        return self._view(self._kb, "_kb")

    @keys.setter
    def keys(self, value):
        self._set("_kb", value)

    @property
    def values(self):
        return self._view(self._vb, "_vb")

    @values.setter
    def values(self, value):
        self._set("_vb", value)

    @property
    def pos(self):
        return self._view(self._pb, "_pb")

    @pos.setter
    def pos(self, value):
        self._set("_pb", value)

    def cap(self) -> int:
        for b in (self._kb, self._vb, self._pb):
            if b is not None:
                return b.shape[2]
        return 0

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
        self._min_cap = max(self._min_cap, n if bound is None else min(n, bound))
        if self._kb is not None and self.cap() < self._min_cap:
            self._resize(self._cap_for(self.held()))

    def _resize(self, cap: int) -> None:
        """Re-allocate every buffer with ``cap`` slots, keeping the held prefix (eager)."""
        self._sync()
        for name in ("_kb", "_vb", "_pb"):
            buf = getattr(self, name)
            if buf is None:
                continue
            n = min(self._len[name], cap)
            new = buf.new_full((*buf.shape[:2], cap, *buf.shape[3:]), -1 if name == "_pb" else 0)
            new[:, :, :n].copy_(buf[:, :, :n])
            setattr(self, name, new)
        self._mark_static()

    def _mark_static(self) -> None:
        if not torch.compiler.is_compiling():  # fixed addresses for CUDA graphs (as transformers' StaticLayer)
            for t in (self._kb, self._vb, self._pb, self.nslots, self.seen_t):
                if t is not None:
                    torch._dynamo.mark_static_address(t)

    def _set(self, name: str, value) -> None:
        """``keys``/``values``/``pos = value`` (``[B, H|Hp, m, ...]``): written into the buffer's first m slots in place;
        m becomes the held count (``pos`` beyond it is set to -1). None drops the buffer. Eager only."""
        if value is None:
            setattr(self, name, None)
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(f"{type(self).__name__}: a compiled step cannot reassign its slots")
        m = value.shape[2]
        bufs = [b for b in (self._kb, self._vb, self._pb) if b is not None]
        if bufs and m > self.cap():
            self._resize(self._cap_for(m))
        cap = self.cap() if bufs else self._cap_for(m)
        buf = getattr(self, name)
        if (buf is None or buf.shape[:2] != value.shape[:2] or buf.shape[3:] != value.shape[3:]
                or buf.dtype != value.dtype or buf.device != value.device):
            buf = value.new_full((*value.shape[:2], cap, *value.shape[3:]), -1 if name == "_pb" else 0)
            setattr(self, name, buf)
            self._mark_static()
        dst = buf[:, :, :m]
        if not (dst.data_ptr() == value.data_ptr() and dst.stride() == value.stride()):
            dst.copy_(value)
        if name == "_pb":
            buf[:, :, m:].fill_(-1)
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
        if torch.compiler.is_compiling():  # a device-side check: no host read
            torch._assert_async(self.nslots + T <= self._kb.shape[2], OVERFLOW)
        ar = torch.arange(T, device=self.nslots.device)
        idx = self.nslots + ar
        self._kb.index_copy_(2, idx, k)
        self._vb.index_copy_(2, idx, v)
        p = (self.seen_t + ar).to(torch.int32).view(1, 1, T).expand(B, self._pb.shape[1], T)
        self._pb.index_copy_(2, idx, p)
        self.nslots.add_(T)
        self.seen_t.add_(T)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._kb is None:
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
            B = self._kb.shape[0]
            if self.first_pos is None:
                self.first_pos = torch.full((B,), self.seen - T, dtype=torch.int32, device=self._kb.device)
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
        if self._kb is None:
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
        return tensor_bytes(self._kb, self._vb, self._pb)


_STATIC_CLASSES: dict = {}


def static_store(cls):
    """The static variant of a :class:`SlotStore` subclass: ``class Static<Name>(StaticSlots, cls)`` (made once).
    Policies build it when ``info.static``; the class must keep its decode path free of host reads."""
    if cls not in _STATIC_CLASSES:
        _STATIC_CLASSES[cls] = type(f"Static{cls.__name__}", (StaticSlots, cls), {"__module__": cls.__module__,
                                                                                "__doc__": StaticSlots.__doc__})
    return _STATIC_CLASSES[cls]
