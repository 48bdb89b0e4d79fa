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
from kvkit.stores import SlotStore, StoreMixin, attend_slots, crop_count, tensor_bytes


# ---- views --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftView:
    """What part of a layer's held KV the self-draft reads, chosen per batch row."""

    name: ClassVar[str] = "base"

    def keep(self, keys, pos, query) -> torch.Tensor | None:
        """Slots to read: a mask ``[B, Hi, n]`` (Hi = 1 or H), or None for every held slot.

        keys ``[B, H, n, D]`` held by the real store; pos ``[B, Hp, n]`` each slot's position in its row's
        sequence (-1: left padding, or a hole left by a rejected draft at batch > 1; never to be read);
        query ``[B, Hq, D]`` of the first token of the forward that builds the view.
        """
        raise NotImplementedError

    def rebuild_every(self) -> int | None:
        """Rebuild the selection after this many new tokens (None: at every drafting round)."""
        return None


@dataclass(frozen=True)
class StreamingView(DraftView):
    """StreamingLLM view: ``sink`` first tokens + the most recent ``budget - sink`` of each row (MagicDec's draft KV).

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

    def keep(self, keys, pos, query):
        valid = pos >= 0
        first = torch.where(valid, pos, torch.iinfo(pos.dtype).max).amin(dim=-1, keepdim=True)
        last = torch.where(valid, pos, -1).amax(dim=-1, keepdim=True)
        if bool((last - first < self.budget).all()):
            return None  # every row fits
        return valid & ((pos < first + self.sink) | (pos > last - (self.budget - self.sink)))


@dataclass(frozen=True)
class RetrievalView(DraftView):
    """TriForce's retrieval cache: chunks of ``chunk`` positions scored by ``q . mean(chunk keys)``, per row.

    Chunk 0 is always kept plus the top ``budget // chunk - 1`` chunks per KV head (query heads of a
    GQA group are summed; TriForce assumes one query head per KV head). Chunks follow each row's own
    positions (left padding and holes are skipped); the incomplete last chunk and slots added after
    the build (generated tokens) are always read. The reference builds it once from the query after
    the prompt and never rebuilds; ``rebuild`` re-selects every that many new tokens.

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

    def keep(self, keys, pos, query):
        B, H, n, D = keys.shape
        valid = pos >= 0  # [B, Hp, n]
        length = pos.amax(dim=-1, keepdim=True) + 1  # [B, Hp, 1] tokens of each row
        full = length // self.chunk  # complete chunks of each row
        C = int(full.max())
        if bool((length <= self.budget).all()) or C <= 1:
            return None
        cid = torch.where(valid & (pos // self.chunk < full), pos // self.chunk, C).long()  # C: not in a chunk
        sums = keys.new_zeros(B, H, C + 1, D, dtype=torch.float32)
        sums.scatter_add_(2, cid.expand(B, H, n)[..., None].expand(B, H, n, D), keys.float())
        q = query.float().view(B, H, -1, D).sum(dim=2)  # [B, H, D]: GQA group summed
        scores = torch.einsum("bhd,bhcd->bhc", q, sums[:, :, :C] / self.chunk)
        scores = scores.masked_fill(torch.arange(C, device=keys.device) >= full, float("-inf"))
        scores[..., 0] = float("inf")  # chunk 0 (sinks) always kept
        top = scores.topk(min(self.budget // self.chunk, C), dim=-1)
        chosen = torch.zeros(B, H, C + 1, dtype=torch.bool, device=keys.device)
        chosen.scatter_(2, top.indices, top.values > float("-inf"))
        keep = chosen.gather(2, cid.expand(B, H, n)) | (valid & (cid == C))
        return keep | ((length <= self.budget) & valid)  # short rows read everything


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
    """``(keys, values, pos [B|1, Hp, n], window)`` a real layer store holds; pos in the store's own slot numbering
    (the count of tokens it had seen when the slot was written); window = the model's sliding window."""
    info = getattr(store, "info", None)
    window = info.sliding_window if info is not None and info.layer_type == "sliding_attention" else None
    if isinstance(store, SlotStore):
        if store.keys is None or not store.keys.shape[-2]:
            return None, None, None, None
        return store.keys, store.values, store.pos, None
    if isinstance(store, DynamicLayer) and store.is_initialized and store.keys is not None and store.keys.numel():
        n, seen = store.keys.shape[-2], store.get_seq_length()
        pos = torch.arange(seen - n, seen, device=store.keys.device, dtype=torch.int32).view(1, 1, n)
        if isinstance(store, DynamicSlidingWindowLayer):
            window = store.sliding_window
        return store.keys, store.values, pos, window
    if isinstance(store, CacheLayerMixin) and not store.is_initialized:
        return None, None, None, None
    raise ValueError(f"the self-draft cannot read a cache layer of type {type(store).__name__}")


def mask_to_index(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep [B, Hi, n]`` bool -> (slot indices ``[B, Hi, k]``, which of them are kept ``[B, Hi, k]``), k = the
    largest count: rows that keep fewer get extra entries marked not kept (read as masked slots)."""
    k = int(keep.sum(dim=-1).max())
    idx = keep.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :k]
    return idx, keep.gather(-1, idx)


class DraftLayer(StoreMixin, CacheLayerMixin):
    """One layer of the draft: a view of the real store plus a private tail of draft-token K/V.

    Two numberings: *slot* positions (the store's own, where causality is checked; new tokens get the
    next ones) and *token* positions (each row's position of the token: RoPE's, where the views and a
    sliding window are applied). They differ only at batch > 1, where the generator hands each round
    the token position of every slot (``-1`` for padding and for holes left by rejected drafts).
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, base, view: DraftView):
        super().__init__()
        self.base, self.view = base, view
        self.info = getattr(base, "info", None)
        self.is_initialized = True
        self.idx = self.ok = None  # [B, Hi, k] selected slots of base and whether each is read (None: all)
        self.built_at = -1  # base length when idx was selected
        self.tail_k = self.tail_v = None
        self.sel = None  # (keys, values, slot pos, token pos, window) of the view for the current round
        self.base_len = base.get_seq_length()
        self.token_pos = None  # [B, n] token position of every base slot (-1: never read); None: = slot pos
        self.bufs = None  # (keys, values) buffers holding a gathered view and room for `room` draft tokens
        self.room = 16
        self.start = None  # [B] token position of the first tail token
        self.rounds = None  # the DraftCache's round state (``tail_pos``), shared by its layers

    # drafting rounds
    def begin_round(self, token_pos=None, start=None) -> None:
        self.tail_k = self.tail_v = None
        self.sel = self.bufs = None
        self.base_len = self.base.get_seq_length()
        self.token_pos, self.start = token_pos, start

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (finished rows leave the batch; the base store selects its own)."""
        if self.idx is not None:
            rows = rows.to(self.idx.device)
            self.idx, self.ok = self.idx[rows], self.ok[rows]

    def _build(self, query) -> None:
        keys, values, spos, window = held_kv(self.base)
        if keys is None:
            self.sel = (None, None, None, None, None)
            return
        B, n = keys.shape[0], keys.shape[-2]
        spos = spos.expand(B, -1, -1)
        if self.token_pos is not None:  # batch rows: slots that hold no token of the row are never read
            tpos = self.token_pos[:, None, :].to(spos.dtype)
            spos = torch.where(tpos >= 0, spos, -1)
        else:
            tpos = spos
        every = self.view.rebuild_every()
        # a compressing store renumbers its slots, and a window moves: re-select every round there
        stale = self.built_at < 0 or every is None or isinstance(self.base, SlotStore) or window is not None
        stale = stale or (every > 0 and self.base_len - self.built_at >= every)
        if stale:
            keep = self.view.keep(keys, tpos, query[:, :, 0])
            if window is not None:  # the model's own sliding window too: only the last `window` positions
                recent = (tpos >= 0) & (tpos > tpos.amax(dim=-1, keepdim=True) - window)
                keep = recent if keep is None else keep & recent
            self.idx, self.ok = (None, None) if keep is None else mask_to_index(keep)
            self.built_at = self.base_len
        if self.idx is None:
            self.sel = (keys, values, spos, tpos, window)
            return
        built_n = n - (self.base_len - self.built_at)  # slots held at build time
        idx, ok = self.idx, self.ok
        if built_n < n:  # tokens added since the build are always read
            new = torch.arange(built_n, n, device=keys.device).view(1, 1, -1).expand(B, idx.shape[1], -1)
            idx, ok = torch.cat([idx, new], dim=-1), torch.cat([ok, torch.ones_like(new, dtype=torch.bool)], dim=-1)
        H, D = keys.shape[1], keys.shape[-1]
        kidx = idx.expand(B, H, -1) if idx.shape[1] == 1 else idx
        g = kidx.unsqueeze(-1).expand(*kidx.shape, D)
        hp = idx.shape[1] if spos.shape[1] == 1 else spos.shape[1]
        gather = lambda p: p.expand(B, hp, -1).gather(2, idx.expand(B, hp, -1))  # noqa: E731
        p = torch.where(ok.expand(B, hp, -1), gather(spos), -1)
        # the view goes into buffers with room for the round's draft tokens, so a draft step copies only the tail
        k = g.shape[2]
        kb, vb = keys.new_empty(B, H, k + self.room, D), values.new_empty(B, H, k + self.room, values.shape[-1])
        kb[:, :, :k].copy_(keys.gather(2, g))
        vb[:, :, :k].copy_(values.gather(2, g))
        self.sel = (kb[:, :, :k], vb[:, :, :k], p, gather(tpos), window)
        self.bufs = (kb, vb)

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
        self.rollback(crop_count(self.get_seq_length(), tokens_to_remove))

    def rollback(self, n: int, ends_round: bool = True) -> None:
        self.check_rollback(n)
        if n > 0:
            self.tail_k, self.tail_v = self.tail_k[..., :-n, :], self.tail_v[..., :-n, :]

    def check_rollback(self, n: int) -> None:
        if n > self.tail_len():
            raise ValueError(f"the draft can only roll back its own {self.tail_len()} draft tokens, not {n}")

    def nbytes(self) -> int:
        return tensor_bytes(self.tail_k, self.tail_v)

    def num_slots(self) -> int:
        return self.tail_len() + (0 if self.sel is None or self.sel[0] is None else self.sel[0].shape[-2])

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        # query [B, Hq, T, D]; the T newest tail tokens are this forward's tokens -> [B, T, Hq, D]
        if self.sel is None:
            self._build(query)
        keys, values, spos, tpos, window = self.sel
        B, T, t = query.shape[0], query.shape[2], self.tail_len()
        total = self.get_seq_length()
        tail_spos = torch.arange(total - t, total, device=query.device, dtype=torch.int32).view(1, 1, t)
        tail_pos = self.rounds.tail_pos if self.rounds is not None else None
        if tail_pos is not None:  # tail slots with holes (a drafter's rejected drafts; the hierarchy's middle level)
            tail_spos = torch.where(tail_pos >= 0, tail_spos.view(1, t), -1).view(B, 1, t)
            tail_tpos = tail_pos.view(B, 1, t)
        else:
            start = torch.full((B,), self.base_len, device=query.device) if self.start is None else self.start
            tail_tpos = start.view(B, 1, 1) + torch.arange(t, device=query.device).view(1, 1, t)  # [B, 1, t]
        if keys is None:
            keys, values, spos, tpos = self.tail_k, self.tail_v, tail_spos.expand(B, 1, t), tail_tpos
        else:
            hp, k = spos.shape[1], keys.shape[-2]
            if self.bufs is not None and t <= self.room:  # the view's buffers: copy the tail in
                kb, vb = self.bufs
                kb[:, :, k : k + t].copy_(self.tail_k)
                vb[:, :, k : k + t].copy_(self.tail_v)
                keys, values = kb[:, :, : k + t], vb[:, :, : k + t]
            else:
                keys = torch.cat([keys, self.tail_k], dim=-2)
                values = torch.cat([values, self.tail_v], dim=-2)
            spos = torch.cat([spos, tail_spos.expand(B, hp, t).to(spos.dtype)], dim=-1)
            tpos = torch.cat([tpos.expand(B, hp, -1), tail_tpos.expand(B, hp, t).to(tpos.dtype)], dim=-1)
        qpos = torch.arange(total - T, total, device=query.device, dtype=torch.int32)
        extra = None
        if window is not None:  # the model's own sliding window, in token positions
            q_tpos = tail_tpos[:, :, t - T :]  # [B, 1, T]
            extra = tpos[:, :, None, :] > q_tpos[..., None] - window
        return attend_slots(query, keys, values, spos, qpos, scaling, extra)


class DraftCache(KVCache):
    """The cache the target model drafts with: one :class:`DraftLayer` view per layer of ``base``.

    A ``KVCache`` subclass (so kvkit's attention routing picks it up) that never copies the full KV.
    """

    def __init__(self, base: KVCache, view: DraftView):  # not KVCache.__init__: no new stores
        self.base, self.view = base, view
        self.policy, self.infos, self.shared = base.policy, base.infos, base.shared
        self.scoring_pass = False  # (KVCache's flag: no policy scoring forward runs through a draft)
        self._model_config = getattr(base, "_model_config", None)
        Cache.__init__(self, layers=[DraftLayer(layer, view) for layer in base.layers])
        self.tail_pos = None  # [B, t] token position of every tail slot (-1: hole), when the drafter sets it
        for layer in self.layers:
            layer.rounds = self

    def begin_round(self, token_pos: torch.Tensor | None = None, start: torch.Tensor | None = None) -> None:
        """Forget the previous round's draft tokens; the view follows the real cache's new length.

        token_pos ``[B, n]``: each base slot's token position in its row (-1: padding / hole), start ``[B]``: the
        token position of the first token fed this round; both None when slots and tokens are numbered alike."""
        self.tail_pos = None
        for layer in self.layers:
            layer.begin_round(token_pos, start)
