"""The sparse-KV self-draft: the target model reads a *view* of its own KV cache while drafting.

A :class:`DraftCache` is handed to the target model instead of its real cache during drafting. Its
layers hold no copy of the full KV: each reads the real layer store (``base``) through a view
(sinks + recent window, or TriForce's retrieved chunks) and keeps only the K/V of the tokens fed
while drafting in a small private *tail*.

Why the tail and not the real cache: the K/V of a draft token computed by a sparse-attention
forward are *not* the target's K/V for that token in layers > 0 (their hidden states saw only the
view). Writing them into the real cache would corrupt it; appending to a full ``DynamicLayer`` would
also copy the whole cache at every draft step. So draft tokens live in the tail, which is dropped at
the start of the next round; the verification forward then computes the true K/V of the accepted
tokens with full attention, and the rejected ones are cropped from the real cache (exact rollback).

The routing needs no change to the core: ``DraftCache`` is a ``KVCache``, so kvkit's attention
pre-hook hands each attention module its draft layer and the registered attention function calls
``DraftLayer.attend``. (The model must be patched; ``kvkit.speculative.generate`` patches an
unpatched model with ``full`` for the duration of the call.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from kvkit.cache import KVCache
from kvkit.policies.base import check_positive_int
from kvkit.stores import SlotStore, StoreMixin, attend_slots, crop_count


# ---- views --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftView:
    """What part of a layer's held KV the self-draft reads."""

    name: ClassVar[str] = "base"

    def select(self, keys, pos, query) -> torch.Tensor | None:
        """Slots to read: ``idx [B, Hi, k]`` sorted (Hi = 1 or H), or None for all held slots.

        keys ``[B, H, n, D]`` held by the real store; pos ``[B, Hp, n]``; query ``[B, Hq, D]`` of the
        first token of the forward that builds the view.
        """
        raise NotImplementedError

    def rebuild_every(self) -> int | None:
        """Rebuild the selection after this many new tokens (None: at every drafting round)."""
        return None


@dataclass(frozen=True)
class StreamingView(DraftView):
    """StreamingLLM view: ``sink`` first tokens + the most recent ``budget - sink`` (MagicDec's draft KV).

    Parameters
    ----------
    budget : int
        Slots read per layer; MagicDec uses 257-4097, 512 in its PG-19 acceptance numbers.
    sink : int
        Attention sinks; MagicDec uses 16.
    """

    budget: int = 512  # MagicDec (2408.11049): 512-token StreamingLLM draft, 0.84 acceptance at 4K
    sink: int = 16  # MagicDec / TriForce: 16 sink tokens

    name: ClassVar[str] = "streaming"

    def __post_init__(self):
        check_positive_int("streaming draft view", "budget", self.budget)
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or not 0 <= self.sink < self.budget:
            raise ValueError(f"streaming draft view: sink must be an integer in [0, budget), got {self.sink!r}")

    def select(self, keys, pos, query):
        n = keys.shape[-2]
        if n <= self.budget:
            return None
        # sinks first, then recency; padding (pos < 0) last
        first = torch.where(pos >= 0, pos, torch.iinfo(torch.int32).max).amin(dim=-1, keepdim=True)
        score = pos.float() + ((pos >= first) & (pos < first + self.sink)).float() * (2 * n + 2)
        score = score.masked_fill(pos < 0, float("-inf"))
        return score.topk(self.budget, dim=-1).indices.sort(dim=-1).values


@dataclass(frozen=True)
class RetrievalView(DraftView):
    """TriForce's retrieval cache: chunks of ``chunk`` slots scored by ``q . mean(chunk keys)``.

    Chunk 0 is always kept plus the top ``budget // chunk - 1`` chunks per KV head (query heads of a
    GQA group are summed; TriForce assumes one query head per KV head). Slots added after the build
    (generated tokens, the < ``chunk`` remainder) are always read. The reference builds it once
    from the query after the prompt and never rebuilds; ``rebuild`` re-selects every that many
    new tokens.

    Parameters
    ----------
    budget : int
        Slots read from the retrieved chunks; 4096 in TriForce's A100 setting.
    chunk : int
        Chunk size; 8 in TriForce.
    rebuild : int or None
        Rebuild after this many new tokens; None = never (the reference).
    """

    budget: int = 4096  # TriForce (2404.11912) A100 setting
    chunk: int = 8  # TriForce: chunk size 8
    rebuild: int | None = None  # TriForce builds once, never rebuilds

    name: ClassVar[str] = "retrieval"

    def __post_init__(self):
        check_positive_int("retrieval draft view", "budget", self.budget)
        check_positive_int("retrieval draft view", "chunk", self.chunk)
        check_positive_int("retrieval draft view", "rebuild", self.rebuild, allow_none=True)
        if self.budget < 2 * self.chunk:
            raise ValueError(
                f"retrieval draft view: budget ({self.budget}) must hold at least two chunks of {self.chunk}"
            )

    def rebuild_every(self):
        return self.rebuild if self.rebuild is not None else -1

    def select(self, keys, pos, query):
        B, H, n, D = keys.shape
        nch = n // self.chunk
        if n <= self.budget or nch <= 1:
            return None
        k_chunks = self.budget // self.chunk
        means = keys[:, :, : nch * self.chunk].float().view(B, H, nch, self.chunk, D).mean(dim=3)  # [B, H, nch, D]
        q = query.float().view(B, H, -1, D).sum(dim=2)  # [B, H, D]: GQA group summed
        scores = torch.einsum("bhd,bhcd->bhc", q, means)
        scores[..., 0] = float("inf")  # chunk 0 (sinks) always kept
        top = scores.topk(min(k_chunks, nch), dim=-1).indices.sort(dim=-1).values  # [B, H, k]
        idx = (top[..., None] * self.chunk + torch.arange(self.chunk, device=keys.device)).flatten(2)
        rest = torch.arange(nch * self.chunk, n, device=keys.device).view(1, 1, -1).expand(B, H, -1)
        return torch.cat([idx, rest], dim=-1)


VIEWS = {"streaming": StreamingView, "retrieval": RetrievalView}


def make_view(policy, options: dict | None = None) -> DraftView:
    """``"streaming"`` / ``"retrieval"`` (+ options) or a ``DraftView`` instance."""
    if isinstance(policy, DraftView):
        if options:
            raise ValueError("draft_options cannot be combined with a DraftView instance")
        return policy
    if policy not in VIEWS:
        raise ValueError(f"unknown draft_policy {policy!r}; known: {', '.join(VIEWS)}")
    try:
        return VIEWS[policy](**(options or {}))
    except TypeError as e:
        raise ValueError(f"bad draft_options for {policy!r}: {e}") from None


# ---- the draft cache ----------------------------------------------------------------------------
def held_kv(store):
    """``(keys, values, pos [B, Hp, n], window)`` a real layer store holds; window = the model's sliding window."""
    if isinstance(store, SlotStore):
        return store.keys, store.values, store.pos, None
    if isinstance(store, DynamicLayer) and store.is_initialized and store.keys is not None and store.keys.numel():
        n, seen = store.keys.shape[-2], store.get_seq_length()
        pos = torch.arange(seen - n, seen, device=store.keys.device, dtype=torch.int32).view(1, 1, n)
        window = store.sliding_window if isinstance(store, DynamicSlidingWindowLayer) else None
        return store.keys, store.values, pos, window
    if isinstance(store, CacheLayerMixin) and not store.is_initialized:
        return None, None, None, None
    raise ValueError(f"the self-draft cannot read a cache layer of type {type(store).__name__}")


class DraftLayer(StoreMixin, CacheLayerMixin):
    """One layer of the draft: a view of the real store plus a private tail of draft-token K/V."""

    is_sliding = False
    is_croppable = True

    def __init__(self, base, view: DraftView):
        super().__init__()
        self.base, self.view = base, view
        self.info = getattr(base, "info", None)
        self.is_initialized = True
        self.idx = None  # [B, Hi, k] selected slots of base (None: all)
        self.built_at = -1  # base length when idx was selected
        self.tail_k = self.tail_v = None
        self.sel = None  # (keys, values, pos) of the view for the current round
        self.base_len = base.get_seq_length()

    # drafting rounds
    def begin_round(self) -> None:
        self.tail_k = self.tail_v = None
        self.sel = None
        self.base_len = self.base.get_seq_length()

    def _build(self, query) -> None:
        keys, values, pos, window = held_kv(self.base)
        if keys is None:
            self.sel = (None, None, None, None)
            return
        every = self.view.rebuild_every()
        # a compressing store renumbers its slots: re-select every round there
        stale = self.built_at < 0 or every is None or isinstance(self.base, SlotStore)
        stale = stale or (every > 0 and self.base_len - self.built_at >= every)
        if stale:
            self.idx = None if window is not None else self.view.select(keys, pos, query[:, :, 0])
            self.built_at = self.base_len
        if self.idx is None:
            self.sel = (keys, values, pos, window)
            return
        built_n = keys.shape[-2] - (self.base_len - self.built_at)  # slots held at build time
        idx = self.idx
        if built_n < keys.shape[-2]:  # tokens added since the build are always read
            new = torch.arange(built_n, keys.shape[-2], device=keys.device).view(1, 1, -1)
            idx = torch.cat([idx, new.expand(idx.shape[0], idx.shape[1], -1)], dim=-1)
        H, D = keys.shape[1], keys.shape[-1]
        kidx = idx.expand(keys.shape[0], H, -1) if idx.shape[1] == 1 else idx
        g = kidx.unsqueeze(-1).expand(*kidx.shape, D)
        p = pos.expand(-1, idx.shape[1], -1).gather(2, idx) if pos.shape[1] != idx.shape[1] else pos.gather(2, idx)
        self.sel = (keys.gather(2, g), values.gather(2, g), p, window)

    # transformers cache-layer API
    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        if self.tail_k is None:
            self.tail_k, self.tail_v = key_states, value_states
        else:
            self.tail_k = torch.cat([self.tail_k, key_states], dim=-2)
            self.tail_v = torch.cat([self.tail_v, value_states], dim=-2)
        return key_states, value_states

    def tail_len(self) -> int:
        return 0 if self.tail_k is None else self.tail_k.shape[-2]

    def get_seq_length(self) -> int:
        return self.base_len + self.tail_len()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.begin_round()

    def crop(self, tokens_to_remove: int) -> None:
        n = crop_count(self.get_seq_length(), tokens_to_remove)
        if n <= 0:
            return
        if n > self.tail_len():
            raise ValueError(f"the draft can only roll back its own {self.tail_len()} draft tokens, not {n}")
        self.tail_k, self.tail_v = self.tail_k[..., :-n, :], self.tail_v[..., :-n, :]

    def nbytes(self) -> int:
        t = [x for x in (self.tail_k, self.tail_v) if x is not None]
        return sum(x.numel() * x.element_size() for x in t)

    def num_slots(self) -> int:
        return self.tail_len() + (0 if self.sel is None or self.sel[0] is None else self.sel[0].shape[-2])

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        # query [B, Hq, T, D]; the T newest tail tokens are this forward's tokens -> [B, T, Hq, D]
        if self.sel is None:
            self._build(query)
        keys, values, pos, window = self.sel
        T, t = query.shape[2], self.tail_len()
        total = self.get_seq_length()
        tpos = torch.arange(total - t, total, device=query.device, dtype=torch.int32).view(1, 1, t)
        if keys is None:
            keys, values, pos = self.tail_k, self.tail_v, tpos
        else:
            hp = pos.shape[1]
            keys = torch.cat([keys, self.tail_k], dim=-2)
            values = torch.cat([values, self.tail_v], dim=-2)
            pos = torch.cat([pos, tpos.expand(pos.shape[0], hp, t)], dim=-1)
        qpos = torch.arange(total - T, total, device=query.device, dtype=torch.int32)
        extra = None
        if window is not None:  # the model's own sliding window
            extra = pos[:, :, None, :] > qpos.view(1, 1, T, 1) - window
        return attend_slots(query, keys, values, pos, qpos, scaling, extra)


class DraftCache(KVCache):
    """The cache the target model drafts with: one :class:`DraftLayer` view per layer of ``base``.

    A ``KVCache`` subclass (so kvkit's attention routing picks it up) that never copies the full KV.
    """

    def __init__(self, base: KVCache, view: DraftView):  # not KVCache.__init__: no new stores
        self.base, self.view = base, view
        self.policy, self.infos, self.shared = base.policy, base.infos, base.shared
        Cache.__init__(self, layers=[DraftLayer(layer, view) for layer in base.layers])

    def begin_round(self) -> None:
        """Forget the previous round's draft tokens; the view follows the real cache's new length."""
        for layer in self.layers:
            layer.begin_round()
