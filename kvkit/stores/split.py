"""Head-split layers: some KV heads of a layer keep every token, the others live in another store.

:class:`HeadSplitStore` holds two stores per layer over disjoint KV heads and routes each query head group to its
KV head's store. It is the layer of DuoAttention (``duo``: retrieval heads whole, streaming heads sinks + recent)
and of the eviction policies' ``protect_heads`` option (:mod:`kvkit.policies.protect_heads`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvkit.stores.base import LayerInfo, SlotStore
from kvkit.stores.buffers import crop_count
from kvkit.stores.layer import SeenLength, StoreMixin
from kvkit.stores.static import static_store


class WholeHeadsStore(SlotStore):
    """The kept heads' store: it never drops a token, so every crop is exact."""

    def crop_floor(self) -> int:
        return 0


class HeadSplitStore(SeenLength, StoreMixin, CacheLayerMixin):
    """KV heads split in two stores per layer, for real (nothing simulated by masking): the ``keep`` heads in a
    :class:`WholeHeadsStore` (every token), the others in ``make_rest(num_heads)`` (any store built over a subset
    of the layer's KV heads, e.g. a :class:`~kvkit.stores.scored.ScoredStore` with ``num_heads``).

    DuoAttention's layer (retrieval heads whole, streaming heads sinks + recent) and the eviction policies'
    ``protect_heads`` option (the heads a DuoAttention pattern ranks highest keep every token, the rest are evicted by
    the policy's score) are this store.

    ``update`` splits the new keys/values ``[B, H, T, D]`` by KV head; ``attend`` routes each group of
    query heads ``query [B, Hq, T, D]`` to its KV head's store and scatters the outputs back into the model's
    head order. In a static cache both parts are static (:func:`~kvkit.stores.static.static_store`; ``make_rest``
    builds the static variant when ``info.static``): the kept part's capacity is the cache's (``max_length`` /
    ``ensure_capacity``); the step's splits and gathers have fixed shapes, so it compiles whole.
    """

    is_sliding = False
    is_croppable = True
    needs_kvkit_attention = True

    def __init__(self, info: LayerInfo, keep: list[bool], make_rest, who: str = "kvkit"):
        super().__init__()
        if len(keep) != info.num_kv_heads:
            raise ValueError(f"{who}: layer {info.layer_idx} needs {info.num_kv_heads} head flags, got {len(keep)}")
        self.info = info
        self.keep = list(map(bool, keep))
        G = info.groups
        k_heads = [h for h, r in enumerate(self.keep) if r]
        r_heads = [h for h, r in enumerate(self.keep) if not r]
        whole_cls = static_store(WholeHeadsStore) if info.static else WholeHeadsStore
        self.whole = whole_cls(info, num_heads=len(k_heads)) if k_heads else None
        self.rest = make_rest(len(r_heads)) if r_heads else None
        # (store, kv head indices, query head indices) per part; kept heads first
        self.parts = []
        for store, heads in ((self.whole, k_heads), (self.rest, r_heads)):
            if store is not None:
                q = [h * G + g for h in heads for g in range(G)]
                self.parts.append((store, torch.tensor(heads), torch.tensor(q)))
        # one gather per tensor puts the heads in parts order (kept first); each part then reads a narrow view
        order = torch.cat([q for _, _, q in self.parts])
        self._q_order, self._q_sizes = order, [len(q) for _, _, q in self.parts]
        self._kv_order = torch.cat([kv for _, kv, _ in self.parts])
        self._kv_sizes = [len(kv) for _, kv, _ in self.parts]
        self._identity = bool(torch.equal(order, torch.arange(info.num_heads)))
        self._kv_identity = bool(torch.equal(self._kv_order, torch.arange(info.num_kv_heads)))
        self._inv = torch.argsort(order)  # model query-head order from the concatenated parts

    # the Cache API peeks at `keys` in a few places (e.g. is_initialized checks): show the first part's
    @property
    def keys(self):
        return self.parts[0][0].keys

    @keys.setter
    def keys(self, value):  # set to None by CacheLayerMixin.__init__; the parts own the tensors
        pass

    @property
    def values(self):
        return self.parts[0][0].values

    @values.setter
    def values(self, value):
        pass

    @property
    def seen(self) -> int:
        return self.parts[0][0].seen

    # ---- static caches: what the parts say -------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        return all(store.is_compileable for store, _, _ in self.parts)

    @property
    def compile_refusal(self) -> str | None:
        return next((store.compile_refusal for store, _, _ in self.parts if not store.is_compileable), None)

    def get_seq_length(self):
        return self.parts[0][0].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parts[0][0].get_mask_sizes(query_length)

    def ensure_capacity(self, n: int) -> None:
        for store, _, _ in self.parts:
            if hasattr(store, "ensure_capacity"):
                store.ensure_capacity(n)

    def before_compiled_step(self, T: int) -> None:
        for store, _, _ in self.parts:
            store.before_compiled_step(T)

    def after_compiled_step(self, T: int) -> None:
        for store, _, _ in self.parts:
            store.after_compiled_step(T)

    # ---- transformers Cache API ----
    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        dev = key_states.device
        self.parts = [(s, kv.to(dev), q.to(dev)) for s, kv, q in self.parts]
        self._inv, self._q_order, self._kv_order = self._inv.to(dev), self._q_order.to(dev), self._kv_order.to(dev)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Store new tokens ``[B, H, T, D]`` (split by KV head); returns them unchanged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if len(self.parts) == 1:
            self.parts[0][0].update(key_states, value_states)
        else:
            for (store, _, _), k, v in zip(self.parts, *self._split_kv(key_states, value_states)):
                store.update(k, v)
        return key_states, value_states

    def _split_kv(self, key, value):
        """``key``/``value`` ``[B, H, T, D]`` -> each part's KV heads (one gather per tensor, then narrow views)."""
        if not self._kv_identity:
            key, value = key.index_select(1, self._kv_order), value.index_select(1, self._kv_order)
        return key.split(self._kv_sizes, 1), value.split(self._kv_sizes, 1)

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """``query [B, Hq, T, D]`` -> ``[B, T, Hq, D]``: each head group reads its own store."""
        if len(self.parts) == 1:
            return self.parts[0][0].attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        qs = (query if self._identity else query.index_select(1, self._q_order)).split(self._q_sizes, 1)
        # the new tokens' K/V are read by the prefill only (exact attention over the prompt); a decode step reads
        # the stores, so it gathers no K/V here
        prefill = not torch.compiler.is_compiling() and self.seen == query.shape[2]
        ks, vs = self._split_kv(key, value) if prefill else ((None,) * len(qs), (None,) * len(qs))
        outs = [store.attend(module, q, k, v, attention_mask, scaling, dropout, **kwargs)
                for (store, _, _), q, k, v in zip(self.parts, qs, ks, vs)]
        out = torch.cat(outs, dim=2)  # [B, T, Hq, D] in parts order
        return out if self._identity else out.index_select(2, self._inv)

    def reset(self) -> None:
        for store, _, _ in self.parts:
            store.reset()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        self.rollback(crop_count(self.seen, tokens_to_remove))

    def check_rollback(self, n: int) -> None:
        for store, _, _ in self.parts:
            store.check_rollback(n)

    def rollback(self, n: int, ends_round: bool = True) -> None:
        self.check_rollback(n)
        for store, _, _ in self.parts:
            store.rollback(n, ends_round=ends_round)

    def reserve(self, n: int) -> None:
        for store, _, _ in self.parts:
            store.reserve(n)

    def reorder_cache(self, beam_idx) -> None:
        for store, _, _ in self.parts:
            store.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for store, _, _ in self.parts:
            store.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        for store, _, _ in self.parts:
            store.batch_select_indices(indices)

    def offload(self):  # the parts hold the tensors; nothing to move at this level
        pass

    def prefetch(self):
        pass

    # ---- accounting ----
    def nbytes(self) -> int:
        return sum(store.nbytes() for store, _, _ in self.parts)

    def read_nbytes(self) -> int:
        return sum(store.read_nbytes() for store, _, _ in self.parts)

    def num_slots(self) -> int:
        return max(store.num_slots() for store, _, _ in self.parts)

    def head_slots(self) -> list[int]:
        """Token slots held per KV head, in the model's head order."""
        out = [0] * self.info.num_kv_heads
        for store, kv, _ in self.parts:
            for h in kv.tolist():
                out[h] = store.num_slots()
        return out
