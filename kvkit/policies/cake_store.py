"""CAKE's store (:class:`CakeStore`) and its cascade: the shared per-cache state (:class:`CakeCascade`) and the
budget allocation (:func:`allocate`); the policy, its options and the algorithm's description are in
:mod:`kvkit.policies.cake`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvkit.policies.knobs import slot_cost
from kvkit.stores import LayerInfo, SlotStore
from kvkit.stores import tensor_bytes as _tensor_bytes
from kvkit.stores.base import new_ring, ring_last, ring_write
from kvkit.stores.scored import pool_group, window_attention

if TYPE_CHECKING:  # annotations only: the policy (Cake, kvkit.policies.cake) is a Policy
    from kvkit.policies.base import Policy

QUERY_SLACK = 64  # decode queries kept beyond `tail`, so crop of up to 64 tokens keeps the scoring exact
EPS = 1e-10  # CAKE entropy epsilon


@dataclass
class CakeCascade:
    """One cache's cascade state: every layer's store, preference and budget ``[B]`` so far."""

    stores: dict = field(default_factory=dict)  # layer -> CakeStore
    pref: dict = field(default_factory=dict)  # layer -> [B] preference
    budgets: dict = field(default_factory=dict)  # layer -> [B] evictable budget
    history: list = field(default_factory=list)  # budgets after each layer's prefill
    protected: torch.Tensor | None = None  # [L, H] bool: the KV heads kept whole (``protect_heads``), or None


def allocate(pref: torch.Tensor, total: int, cap: torch.Tensor) -> torch.Tensor:
    """Integer budgets ``[B, m]`` from preferences ``pref [B, m]``: shares ``pref / sum`` of ``total``, capped at
    ``cap [B]`` (or per layer, ``[B, m]``); the capped excess and the rounding remainder are spread equally over the uncapped layers
    (the first ones get the remainder), so each row sums to ``total`` unless every layer is capped."""
    B, m = pref.shape
    pref = pref.double().clamp(min=0).nan_to_num(0.0)
    s = pref.sum(-1, keepdim=True)
    share = torch.where(s > 0, pref / s.clamp(min=1e-300), torch.full_like(pref, 1.0 / m))
    capm = (cap.view(B, 1) if cap.dim() == 1 else cap).long().expand(B, m)
    b = torch.floor(share * total).long().minimum(capm)
    for _ in range(m + 1):
        amount = total - b.sum(-1)  # [B]
        free = b < capm
        nfree = free.sum(-1)
        if not bool(((amount > 0) & (nfree > 0)).any()):
            break
        per = amount.clamp(min=0) // nfree.clamp(min=1)
        rem = amount.clamp(min=0) % nfree.clamp(min=1)
        rank = free.long().cumsum(-1) - 1
        b = (b + torch.where(free, per[:, None] + (rank < rem[:, None]).long(), 0)).minimum(capm)
    return b


class CakeStore(SlotStore):
    """One CAKE layer: per-KV-head positions (``pos [B, H, n]``), the prefill indicator while the cascade
    runs, the live-token size of each row for decode and the last decode queries for decode scoring."""

    _batch_tensors = SlotStore._batch_tensors + ("score", "size", "qbuf")

    def __init__(self, info: LayerInfo, policy: Policy, tau1: float, tau2: float, num_heads: int | None = None,
                 budget_at=None):
        super().__init__(info, num_heads)
        self.budget_at = budget_at  # compression_ratio: ``context -> budget`` at each prefill
        self.budget, self.window, self.gamma = policy.budget, policy.window, policy.gamma
        self.kernel = policy.pool_kernel if policy.pool_kernel is not None else 5
        self.pool_window = policy.pool_window or "centered"
        self.tail = policy.tail if policy.tail is not None else policy.window
        self.tau1, self.tau2 = tau1, tau2
        self.score: torch.Tensor | None = None  # [B, H, n] prefill indicator (+inf window, -inf dead)
        self.size: torch.Tensor | None = None  # [B] live tokens a row keeps at decode (budget + window)
        self.qbuf: torch.Tensor | None = None  # [B, Hq, nq, D] last decode queries (static: a ring, see below)
        self.qbuf_pos: torch.Tensor | None = None  # static: [tail + QUERY_SLACK] the ring's positions
        #: tokens still to append before some row reaches ``size + tail`` live slots (the compression trigger),
        #: counted on the host so a decode step reads nothing from the device; None: re-read at the next check
        self.countdown: int | None = None
        self.scaling = info.head_dim**-0.5
        info.shared.stores[info.layer_idx] = self

    def reset(self) -> None:
        super().reset()
        self.score = self.size = self.qbuf = self.qbuf_pos = self.countdown = None

    def arm(self) -> None:
        """Read how many tokens may be appended before the first row triggers a compression (one host read, at
        prefill or a compression event). Every appended token is counted off; a row whose new token is padding
        gains no live slot, so the countdown can only run out early, never late (an early check compresses no
        row: :meth:`compress` decides per row on the device)."""
        self.countdown = None if self.size is None else int((self.size + self.tail - self.live()[:, 0]).min())
        if self.static and self.size is not None:  # the capacity follows the decode size (a host read here too)
            self._bound = int(self.size.max()) + self.tail + 1
            self._fit()
            if self.qbuf is None:  # the decode-query ring exists before the first compiled step (fixed inputs)
                B, _, _, D = self.keys.shape
                self.qbuf, self.qbuf_pos = new_ring(B, self.num_store_heads * self.info.groups, self.tail + QUERY_SLACK, D,
                                                    self.keys.dtype, self.keys.device)

    def slots_bound(self) -> int | None:
        """Static capacity: the largest row's decode size + ``tail`` (known once the cascade ran)."""
        return getattr(self, "_bound", None)

    def appended(self, T: int) -> None:
        if self.countdown is not None:
            self.countdown -= T

    def _apply_batch(self, fn) -> None:
        super()._apply_batch(fn)
        self.countdown = None

    def nbytes(self) -> int:
        return super().nbytes() + _tensor_bytes(self.score, self.size, self.qbuf, self.first_pos)

    def read_nbytes(self) -> int:
        """What a decode step's attention reads: the held K/V and positions (not the scoring state)."""
        return SlotStore.nbytes(self)

    def live(self) -> torch.Tensor:
        """Live (readable) tokens per row and KV head ``[B, H]``."""
        return (self.pos >= 0).sum(-1)

    # ---- bookkeeping -------------------------------------------------------------------------
    def keep_slots(self, idx: torch.Tensor) -> None:
        super().keep_slots(idx)
        if self.score is not None:
            self.score = self.score.gather(2, idx.expand(-1, self.score.shape[1], -1))

    def _drop_last(self, n: int) -> None:
        super()._drop_last(n)
        self.countdown = None  # the dropped tokens may have been padding: re-read
        if self.score is not None:
            self.score = self.score[..., :-n]
        if self.qbuf is not None and self.static:
            self.qbuf_pos.masked_fill_(self.qbuf_pos >= self.seen - n, -1)
        elif self.qbuf is not None:
            self.qbuf = self.qbuf[:, :, : max(self.qbuf.shape[2] - n, 0)]

    def _evict_to(self, score: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep the ``keep [B]`` best live slots of every (row, KV head) by ``score [B, H, n]``; the rest of a
        row's rectangle becomes dead slots (position -1), placed before its live slots in slot order."""
        n = self.keys.shape[-2]
        kmax = min(int(keep.max()), n)
        if kmax >= n and bool((self.live() <= keep[:, None]).all()):
            return
        score = score.masked_fill(self.pos < 0, float("-inf"))
        top = score.topk(kmax, dim=-1)
        ok = (torch.arange(kmax, device=score.device).view(1, 1, kmax) < keep.view(-1, 1, 1)) & (
            top.values > float("-inf")
        )
        order = torch.where(ok, top.indices + n, top.indices).argsort(dim=-1)  # dead first, live in slot order
        idx = top.indices.gather(-1, order)
        ok = ok.gather(-1, order)
        self.keep_slots(idx)
        self.pos = torch.where(ok, self.pos, -1).contiguous()
        if self.score is not None:
            self.score = self.score.masked_fill(~ok, float("-inf"))

    # ---- prefill: preference, indicator, cascade -------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        self.scaling = scaling
        out = super().attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        self.record_queries(query)
        return out

    def record_queries(self, query: torch.Tensor) -> None:
        """A decode forward's queries, for decode scoring: the last ``tail + QUERY_SLACK`` of them (a static store
        keeps them in a ring written in place, :func:`~kvkit.stores.base.ring_write`)."""
        T = query.shape[2]
        if self.static:
            if torch.compiler.is_compiling() or self.seen > T:
                self.qbuf, self.qbuf_pos = ring_write(self.qbuf, self.qbuf_pos, query.detach(), self.seen_t - T,
                                                      self.tail + QUERY_SLACK)
            return
        if self.seen > T:
            q = query.detach()
            self.qbuf = q if self.qbuf is None else torch.cat([self.qbuf, q], dim=2)
            self.qbuf = self.qbuf[:, :, -(self.tail + QUERY_SLACK) :]

    def _window_attention(self, qw: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        return window_attention(qw, self.keys, self.pos, qpos, self.scaling)

    def _pool_group(self, x: torch.Tensor) -> torch.Tensor:
        return pool_group(x, self.kernel, self.keys.shape[1], window=self.pool_window)

    def on_prefill(self, query, module) -> None:
        B, Hq, S, D = query.shape
        if self.budget_at is not None:
            self.budget = self.budget_at(self.seen, slot_cost(self.keys))
        w = min(self.window, S)
        real = (self.pos[:, 0] >= 0).sum(-1)  # [B]
        qpos = torch.arange(S - w, S, device=query.device, dtype=torch.int32)
        A = self._window_attention(query[:, :, S - w :], qpos)  # [B, Hq, w, S]
        a_nw = A[..., : S - w]
        # layer preference (CAKE eq.: entropy and variance on the non-window keys), float64 for the powers
        ent = -(a_nw * torch.log(a_nw + EPS)).sum(dim=(1, 2, 3)).double()
        var_w = a_nw.var(dim=2) if w > 1 else torch.zeros_like(a_nw[:, :, 0])
        var = var_w.sum(dim=(1, 2)).double()
        pref = ent.clamp(min=0) ** (1.0 / self.tau1) * var.clamp(min=0) ** (1.0 / self.tau2)  # [B]
        # eviction indicator: mean + gamma * variance over window queries, pooled, group-averaged
        ind = A.mean(dim=2) + self.gamma * (A.var(dim=2) if w > 1 else 0.0)
        nw = self._pool_group(ind[..., : S - w])
        win = torch.full((B, nw.shape[1], w), float("inf"), device=nw.device)
        self.score = torch.cat([nw, win], dim=-1).masked_fill(self.pos < 0, float("-inf"))
        self._cascade(pref, real, w)

    def _cascade(self, pref: torch.Tensor, real: torch.Tensor, w: int) -> None:
        st = self.info.shared
        stores = st.stores
        m = self.info.layer_idx
        if m == min(stores):  # first layer of a new prompt
            st.pref.clear()
            st.budgets.clear()
            st.history.clear()
        st.pref[m] = pref
        layers = sorted(st.pref)
        evict = real > self.budget + self.window  # [B] rows long enough to evict anything
        cap = (real - w).clamp(min=0)
        # Layers may live on different devices (device_map="auto"): the allocation runs on this layer's
        # device, and each store's budget and size are kept on that store's own device.
        dev = real.device
        pref_m = torch.stack([st.pref[i].to(dev) for i in layers], dim=-1)
        heads = [stores[i].num_store_heads for i in layers]
        if len({s.num_store_heads for s in stores.values()}) == 1:  # every layer evicts in all its KV heads
            alloc = allocate(pref_m, (self.budget - self.window) * len(stores), cap)
        else:  # protect_heads: layers differ in evicted heads; the budget is per evicted head, shared in head-slots
            total = (self.budget - self.window) * sum(s.num_store_heads for s in stores.values())
            h = torch.tensor(heads, device=dev)
            alloc = allocate(pref_m, total, cap[:, None] * h) // h
        for j, i in enumerate(layers):
            store = stores[i]
            b = torch.where(evict, alloc[:, j], cap)
            prev = st.budgets.get(i)
            if prev is not None:
                b = b.minimum(prev.to(dev))
            sdev = store.pos.device
            st.budgets[i] = b.to(sdev)
            if prev is None or bool((b < prev.to(dev)).any()):
                store._evict_to(store.score, (b + w).to(sdev))
            store.size = torch.where(evict, b + w, real.clamp(min=self.budget)).to(sdev)
        st.history.append({i: st.budgets[i] for i in layers})
        if m == max(stores):  # cascade done: the prefill indicators are no longer needed
            for store in stores.values():
                store.score = None
                store.arm()

    # ---- decode ------------------------------------------------------------------------------
    def should_compress(self) -> bool:
        if self.size is None:
            return False
        if self.countdown is None:
            self.arm()
        return self.countdown <= 0

    def compress(self) -> None:
        live = self.live()[:, 0]
        trig = live >= self.size + self.tail
        keep = torch.where(trig, self.size, live)
        self._evict_to(self._decode_score(), keep)
        self.arm()

    def _decode_score(self) -> torch.Tensor:
        """Indicator ``[B, H, n]`` from the last ``tail`` decode queries: mean softmax over held slots, the
        non-window part pooled and group-averaged; the last ``window`` slots +inf."""
        n = self.keys.shape[-2]
        w = min(self.window, n)
        B, H = self.keys.shape[:2]
        if self.qbuf is None or self.qbuf.shape[2] == 0 or (self.static and not bool((self.qbuf_pos >= 0).any())):
            return self.pos.float()  # no decode query yet: keep the newest
        if self.static:
            q, qpos = ring_last(self.qbuf, self.qbuf_pos, self.tail, self.seen)
        else:
            q = self.qbuf[:, :, -self.tail :]
            nq = q.shape[2]
            qpos = torch.arange(self.seen - nq, self.seen, device=q.device, dtype=torch.int32)
        A = self._window_attention(q, qpos).mean(dim=2)  # [B, Hq, n]
        nw = self._pool_group(A[..., : n - w])
        win = torch.full((B, H, w), float("inf"), device=nw.device)
        return torch.cat([nw, win], dim=-1)


def cascade_history(cache) -> list[dict[int, torch.Tensor]]:
    """Per-layer budgets ``[B]`` after each layer's prefill (the cascade), for inspection and tests."""
    return list(cache.shared.history)
