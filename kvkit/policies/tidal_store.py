"""TidalDecode's store (:class:`TidalStore`), the selection its layers share (:class:`TidalSelection`), the
selection helpers and the read accounting (:func:`decode_read_bytes`); the policy, its options and the method's
description are in :mod:`kvkit.policies.tidal`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvkit.kernels import gather_attend
from kvkit.stores import LayerInfo, SlotStore, attend_slots

if TYPE_CHECKING:  # annotations only: the policy (Tidal, kvkit.policies.tidal) is a Policy
    from kvkit.policies.base import Policy

MAX_SPARSE_CHUNK = 16  # longer multi-token forwards (chunked prefill) run exact full attention


@dataclass
class TidalSelection:
    """The selection one cache's layers share: made at a selection layer, read by the reuse layers after it.

    ``idx [B, Hs, T, k+1]`` int64: per list (Hs = KV heads or query heads) and query token, the selected
    slots in increasing order (in score order with ``layer_shares``) followed by the token's own slot; ``valid`` the same shape (bool) or None
    when every entry is a real token. ``ranked [B, Hs, T, k]``: the same selection in decreasing score order
    (``ranked_ok`` its real entries, None: all), from which :meth:`view` cuts a smaller top-k for a reuse layer with a
    smaller budget (``layer_shares``). ``bufs``: gather buffers shared by the reuse layers (torch path).
    """

    seen: int = -1  # the store length it was made at
    T: int = 0  # query tokens of that forward
    idx: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    ranked: torch.Tensor | None = None
    ranked_ok: torch.Tensor | None = None
    cur: tuple = ()  # (the query tokens' own slots [B, Hs, T, 1], their validity or None)
    n: int = 0  # slots held when it was made
    slot_order: bool = True  # the whole selection in slot order (uniform budgets); False: score order (layer_shares)
    views: dict = field(default_factory=dict)  # (k, device) -> (idx, valid)
    bufs: dict = field(default_factory=dict)  # (device, dtype, rows, D) -> (K rows, V rows) gather buffers

    def clear(self) -> None:
        self.seen, self.idx, self.valid, self.ranked, self.ranked_ok, self.cur, self.views = -1, None, None, None, None, (), {}

    def set(self, seen: int, T: int, ranked, ranked_ok, n: int, cur, cur_ok, slot_order: bool = True) -> None:
        """A new selection: ``ranked`` top-k slots (decreasing score), ``ranked_ok`` their validity (None: all real),
        ``n`` the held slots, ``cur [B, Hs, T, 1]`` the query tokens' own slots and ``cur_ok`` their validity."""
        self.seen, self.T, self.ranked, self.ranked_ok, self.cur, self.views = seen, T, ranked, ranked_ok, (cur, cur_ok), {}
        self.n, self.slot_order = n, slot_order
        self.idx, self.valid = self._cut(ranked.shape[-1])

    def _cut(self, k: int):
        """The top ``k`` plus the query tokens' own slots. The whole selection (``k`` = all of it, what every layer
        reads with uniform budgets) is put in slot order; with ``layer_shares`` every cut keeps the score order:
        sorting the cuts costs more than the gathers they would speed up (they read whole rows in any order)."""
        r = self.ranked[..., :k]
        cur, cur_ok = self.cur
        whole = k == self.ranked.shape[-1] and self.slot_order
        if self.ranked_ok is None:
            idx, valid = (r.sort(dim=-1).values if whole else r), None
        elif whole:
            key = torch.where(self.ranked_ok, r, self.n).sort(dim=-1).values  # selected first, slot order
            valid = key < self.n
            idx = torch.where(valid, key, 0)
        else:
            valid = self.ranked_ok[..., :k]
            idx = torch.where(valid, r, 0)
        idx = torch.cat([idx, cur], dim=-1)
        if valid is not None or cur_ok is not None:
            v0 = valid if valid is not None else torch.ones_like(r, dtype=torch.bool)
            c0 = cur_ok if cur_ok is not None else torch.ones_like(cur, dtype=torch.bool)
            valid = torch.cat([v0, c0], dim=-1)
        return idx, valid

    def view(self, k: int, device) -> tuple:
        """``(idx, valid)`` of the top-``k`` of this selection (all of it when ``k`` covers it), on ``device``."""
        key = (min(k, self.ranked.shape[-1]), device)
        v = self.views.get(key)
        if v is None:
            v = (self.idx, self.valid) if key[0] == self.ranked.shape[-1] else self._cut(key[0])
            if v[0].device != device:  # the selection layer sits on another device (device_map): copy once
                v = (v[0].to(device), None if v[1] is None else v[1].to(device))
            self.views[key] = v
        return v


class TidalStore(SlotStore):
    """All tokens held (never evicts) in preallocated buffers; decode reads all of them or only the shared
    selection.

    Static (``static_store(TidalStore)``, a compiled step): the buffers hold ``cap`` slots (free ones at position
    -1), so the step selects among all ``cap`` slots with the masked path (free slots are no candidates), the token's
    own slot is ``nslots - T + arange(T)``, a reuse layer trusts the selection of the same forward (no host check)
    and reads its rows with :func:`kvkit.kernels.gather_attend` (a compiled step: one torch gather, fixed shapes)."""

    def __init__(self, info: LayerInfo, policy: Policy):
        super().__init__(info)
        self.policy = policy
        self._configure(policy)
        self.last_read = 0  # K/V bytes read by the last decode forward
        self.last_full_read = 0  # K/V bytes full attention would have read in that forward

    def _configure(self, policy: Policy) -> None:
        info = self.info
        L, i = info.num_layers, info.layer_idx
        self.budget = policy.layer_budgets(L)[i]  # tokens this layer reads from a selection (reuse layers)
        self.per_kv_head = policy.selection == "kv_head"
        self.shared = policy.selection == "shared"
        self.kv_reduce = policy.kv_reduce
        layers = policy.selection_layers(L)
        self.role = "full" if i < layers[0] else "select" if i in layers else "reuse"
        # tokens ranked when this layer selects: the largest budget of the layers that read the selection
        self.select_k = policy.select_budget(L, i) if self.role == "select" else self.budget
        self.shared_budgets = policy.layer_shares is not None  # per-layer cuts of one selection (score order)

    def on_prefill(self, query, module) -> None:
        """``compression_ratio``: the budget for this context length (the prefill's)."""
        self.configure_for(self.seen)

    def configure_for(self, context: int) -> None:
        """``compression_ratio``: the budget for a ``context``-token cache (no-op without one)."""
        p = self.policy
        if p.compression_ratio is not None:
            b = p.budget_for(self.info.num_layers, self.info.groups, context)
            self._configure(dataclasses.replace(p, budget=b, compression_ratio=None))

    def reset(self) -> None:
        super().reset()
        self.last_read = self.last_full_read = 0
        self.info.shared.clear()

    def read_nbytes(self) -> int:
        """K/V bytes read by this layer's last decode forward (0 before any decode)."""
        return self.last_read

    def _row_bytes(self) -> int:
        return 2 * self.keys.shape[-1] * self.keys.element_size()  # one K row + one V row

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        B, Hq, T, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        self.last_full_read = B * H * n * self._row_bytes()
        sel = self.info.shared
        k = self.select_k if self.role == "select" else self.budget
        if T > MAX_SPARSE_CHUNK or k >= n - 1 or self.role == "full":
            if T > MAX_SPARSE_CHUNK:
                sel.clear()
            self.last_read = self.last_full_read
            return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling, dense=self.dense_decode(T))
        if self.role == "select":
            return self._select(query, qpos, scaling)
        if torch.compiler.is_compiling():  # a selection layer ran earlier in this same forward: no host check
            return self._reuse(query, sel, scaling)
        if sel.idx is None or sel.seen != self.seen or sel.T != T:
            return self._select(query, qpos, scaling)
        return self._reuse(query, sel, scaling)

    def _select(self, query, qpos, scaling):
        """Full attention and the top-k selection of every query token; returns ``[B, T, Hq, D]``.

        One ``q K^T`` gives both: the output (softmax times V) and the ranking. With one query token and no
        padding every slot but the last (the token itself) is a candidate and nothing is masked.

        Precision is that of transformers' eager attention and of the paper's code: both matmuls run in the
        cache's dtype, the softmax (and the ranking) in fp32 on the ``[B, H, G*T, n]`` scores. No fp32 copy of
        K or V is made: in bf16 such a copy reads the layer's K/V once and writes and reads twice its bytes."""
        B, Hq, T, D = query.shape
        H, n = self.keys.shape[1], self.keys.shape[2]
        G = Hq // H
        k = min(self.select_k, n)
        q = query.to(self.keys.dtype).reshape(B, H, G * T, D)  # row g*T + t of KV head h is query head h*G + g
        s = torch.matmul(q, self.keys.transpose(-1, -2)).float().mul_(scaling)  # [B, H, G*T, n]
        s5 = s.view(B, H, G, T, n)
        pos = self.pos[:, :1, None, None, :]  # [B, 1, 1, 1, n]: all heads hold the same tokens
        plain = self.dense_decode(T)  # one query, every held slot a real token (no host read)
        if not plain:
            q5 = qpos.view(1, 1, 1, T, 1)
            s5.masked_fill_(~((pos <= q5) & (pos >= 0)), float("-inf"))
        p = torch.softmax(s, dim=-1)
        if not plain:
            p = torch.nan_to_num(p, nan=0.0)
        p5 = p.view(B, H, G, T, n)
        if plain:  # candidates: every slot before the current token's (the last one)
            if self.per_kv_head:
                score = group_score(p5[..., : n - 1], self.kv_reduce)  # [B, H, 1, n-1]
            else:
                score = s5[..., : n - 1].reshape(B, Hq, T, n - 1)
            top = score.topk(min(k, n - 1), dim=-1)  # decreasing score
            ranked, ranked_ok, m = top.indices, None, n - 1  # every list holds real tokens only
        else:  # candidates: real tokens before each query's own position
            cand = (pos < qpos.view(1, 1, 1, T, 1)) & (pos >= 0)  # [B, 1, 1, T, n]
            if self.per_kv_head:
                score = group_score(p5.masked_fill(~cand, 0.0), self.kv_reduce)  # [B, H, T, n]
                score = score.masked_fill(~cand[:, :, 0], float("-inf"))
            else:
                score = s5.masked_fill(~cand, float("-inf")).view(B, Hq, T, n)
            top = score.topk(k, dim=-1)
            ranked, ranked_ok, m = top.indices, top.values > float("-inf"), n
        if self.shared:  # the query heads' lists merged into one, repeated for every KV head
            ranked, ranked_ok = union_ranks(ranked, ranked_ok, m, H)
        Hs = ranked.shape[1]
        if torch.compiler.is_compiling():  # static buffers: the tokens sit at the device count, not at the end
            cur_slot = self.nslots - T + torch.arange(T, device=query.device)
        else:
            cur_slot = torch.arange(n - T, n, device=query.device)
        cur = cur_slot.view(1, 1, T, 1).expand(B, Hs, T, 1)
        cur_ok = None if plain else (self.pos[:, 0].index_select(-1, cur_slot) >= 0).view(B, 1, T, 1).expand(B, Hs, T, 1)
        sel = self.info.shared
        sel.set(self.seen, T, ranked, ranked_ok, n, cur, cur_ok, slot_order=not self.shared_budgets)
        self.last_read = self.last_full_read
        out = torch.matmul(p.to(self.values.dtype), self.values)  # [B, H, G*T, Dv]
        return out.view(B, H, G, T, -1).reshape(B, Hq, T, -1).transpose(1, 2).to(query.dtype)

    def _reuse(self, query, sel, scaling):
        """Attention over the selected rows plus the current token only; returns ``[B, T, Hq, D]``."""
        idx, valid = sel.view(self.budget, query.device)  # [B, Hs, T, k+1]: this layer's top-k of the selection
        out = gather_attend(query, self.keys, self.values, idx, valid, scaling, bufs=sel.bufs)
        self.last_read = idx.numel() * self._row_bytes()
        return out


def union_ranks(indices: torch.Tensor, ok: torch.Tensor | None, m: int, H: int) -> tuple:
    """``selection="shared"``: one list per query token, the union of the query heads' rankings taken rank by rank.

    ``indices [B, Hq, T, k]`` each query head's top-k candidates (decreasing score), ``ok`` their validity (None:
    all real), ``m`` the candidates. A token's key is ``rank * Hq + head`` of its best place in any head's list; the
    ``k`` smallest keys are every head's first choice, then every head's second, ... (the order a round-robin
    merge of the lists with duplicates dropped gives). Returns ``(ranked, ranked_ok)``: ``ranked [B, H, T, k]``
    the shared list repeated for the ``H`` KV heads (so the reuse layers read it as one list per KV
    head), ``ranked_ok`` its validity or None when ``ok`` is None (the union of ``Hq`` lists of ``k`` real tokens
    holds at least ``k``)."""
    B, Hq, T, k = indices.shape
    big = Hq * (k + 1)
    key = (torch.arange(k, device=indices.device) * Hq).view(1, 1, 1, k) + torch.arange(
        Hq, device=indices.device).view(1, Hq, 1, 1)
    key = key.expand(B, Hq, T, k)
    if ok is not None:
        key = torch.where(ok, key, big)
    best = torch.full((B, T, m), big, dtype=torch.long, device=indices.device)
    best.scatter_reduce_(-1, indices.transpose(1, 2).reshape(B, T, Hq * k), key.transpose(1, 2).reshape(B, T, Hq * k),
                         reduce="amin")
    r = best.topk(k, dim=-1, largest=False)  # increasing key: round-robin order
    ranked = r.indices.view(B, 1, T, k).expand(B, H, T, k).contiguous()
    if ok is None:
        return ranked, None
    return ranked, (r.values < big).view(B, 1, T, k).expand(B, H, T, k).contiguous()


def group_score(p: torch.Tensor, kv_reduce: str) -> torch.Tensor:
    """``selection="kv_head"``: one score per KV head from its query group's softmax probabilities ``p [B, H, G, ...]``
    (dim 2 the group), reduced by ``kv_reduce`` ("max" or "sum")."""
    return p.amax(dim=2) if kv_reduce == "max" else p.sum(dim=2)


def decode_read_bytes(cache) -> dict:
    """K/V bytes read by the last decode forward of ``cache``: ``{"read", "full", "ratio"}`` (full / read).

    Layers that are not tidal stores count as reading everything they hold (``nbytes`` of K/V).
    """
    read = full = 0
    for layer in cache.layers:
        if isinstance(layer, TidalStore):
            read += layer.last_read
            full += layer.last_full_read
        else:
            b = layer.nbytes()
            read += b
            full += b
    return {"read": read, "full": full, "ratio": (full / read) if read else None}
