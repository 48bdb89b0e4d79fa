"""The store layer under the policies: ``SlotStore`` (tokens held as slots with their absolute positions), on
``LayerInfo`` (what a store knows about its layer; defined in :mod:`kvkit.model_info`, which builds it from the
config), :class:`~kvkit.stores.layer.StoreMixin` (what every kvkit layer adds to transformers' ``CacheLayerMixin``)
and the in-place buffers of :mod:`kvkit.stores.buffers`, re-exported here. Stores import kernels, never policies."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvkit.model_info import LayerInfo  # noqa: F401  (re-exported: stores build on it)
from kvkit.stores.attend import attend_slots, hf_sdpa
from kvkit.stores.buffers import crop_count, grow_in_place, new_ring, ring_last, ring_write  # noqa: F401
from kvkit.stores.layer import SeenLength, StoreMixin, tensor_bytes


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
    #: per-slot tensors ``[B, H, n]`` beyond keys/values/pos that a static variant keeps in static buffers
    #: (:func:`kvkit.stores.static.static_store`): attribute name -> a free slot's value (= a new token's value)
    static_slot_tensors: dict = {}
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

    def off_slot_nbytes(self) -> int:
        """Bytes the store allocates outside its slot tensors (a static variant adds them to its buffers')."""
        return 0

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
