"""Merging KV slots into sized centroids: ToMe's bipartite soft matching inside fixed-size chunks (``chelsea``).

One round over a chunk's ``L`` slots splits them alternately in time into A (even) and B (odd); every A slot is
matched to its most similar B slot (cosine similarity of the keys) and the ``r`` most similar pairs merge: the B
slot becomes the size-weighted mean of both keys and of both values, its size the sum of the sizes, its position
the later one. Rounds repeat until the chunk holds ``target`` slots; the slots stay in time order between rounds.

Shapes: a chunk grid is ``k, v [..., L, D]``, ``pos [..., L]`` (int), ``size [..., L]`` (float cluster sizes), any
leading dimensions (the store uses ``[B, H, C, L]`` for ``C`` chunks of ``L`` slots per row and KV head).

* :func:`merge_chunks`: every slot of a chunk takes part;
* :func:`merge_keep_top`: the ``protect`` highest-scored slots of every chunk stay exact, the others merge;
* :func:`merge_free` / :func:`merge_keep_top_context`: the protected slots are ranked per KV head over all the
  chunks together (a chunk may keep more or fewer exact), each chunk merges its other slots to the same number;
* :func:`chunk_grid`, :func:`take_slots`, :func:`compact_valid`: where the chunks lie among a store's slots, and
  the gathers that move slots between a store and a grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rows(x, idx):
    """Rows ``idx [..., m]`` of ``x [..., n, D]``: ``[..., m, D]``."""
    return x.gather(-2, idx[..., None].expand(*idx.shape, x.shape[-1]))


def _merge_into(x, src, dst, w_src, s_dst, new_size):
    """Size-weighted means: A rows ``src`` of ``x`` (even slots) merged into B rows ``dst`` (odd slots)."""
    xa, xb = x[..., 0::2, :], x[..., 1::2, :]
    d_idx = dst[..., None].expand(*dst.shape, x.shape[-1])
    acc = (xb * s_dst[..., None]).scatter_add(-2, d_idx, rows(xa, src) * w_src[..., None])
    return acc / new_size[..., None]


def merge_chunks(k, v, pos, size, target: int):
    """Bipartite soft matching inside every chunk down to ``target`` slots.

    k, v ``[..., L, D]`` (float); pos ``[..., L]`` int; size ``[..., L]`` float (cluster sizes).
    Returns the same four with ``L`` replaced by ``target`` (slots sorted by position).
    """
    cur = k.shape[-2]
    while cur > target:
        n_a = (cur + 1) // 2
        r = min(cur - target, n_a)  # merges this round (at most one per A slot)
        ka, kb = k[..., 0::2, :], k[..., 1::2, :]
        sim = F.normalize(ka, dim=-1) @ F.normalize(kb, dim=-1).transpose(-1, -2)  # [..., nA, nB]
        best, dst = sim.max(dim=-1)  # each A slot's most similar B slot
        order = best.argsort(dim=-1, descending=True, stable=True)
        src, rest = order[..., :r], order[..., r:]  # the r most similar pairs merge; the rest of A stays
        dst = dst.gather(-1, src)
        sa, sb = size[..., 0::2], size[..., 1::2]
        w_src = sa.gather(-1, src)
        new_size = sb.scatter_add(-1, dst, w_src)
        kb_new = _merge_into(k, src, dst, w_src, sb, new_size)
        vb_new = _merge_into(v, src, dst, w_src, sb, new_size)
        pa, pb = pos[..., 0::2], pos[..., 1::2]
        pb_new = pb.scatter_reduce(-1, dst, pa.gather(-1, src), reduce="amax")  # latest member's position
        k = torch.cat([rows(ka, rest), kb_new], dim=-2)
        v = torch.cat([rows(v[..., 0::2, :], rest), vb_new], dim=-2)
        pos = torch.cat([pa.gather(-1, rest), pb_new], dim=-1)
        size = torch.cat([sa.gather(-1, rest), new_size], dim=-1)
        srt = pos.argsort(dim=-1, stable=True)  # keep time order so the next partition alternates in time
        k, v, pos, size = rows(k, srt), rows(v, srt), pos.gather(-1, srt), size.gather(-1, srt)
        cur -= r
    return k, v, pos, size


def merge_free(k, v, pos, size, frozen, target: int):
    """Bipartite soft matching inside every chunk over its *free* slots only: the ``frozen`` slots (protected) stay
    as they are and every chunk merges its free slots down to ``target`` (each chunk may hold a different number of
    frozen slots; ``target`` <= its free slots). Same rounds as :func:`merge_chunks` on the free slots in time order
    (with the same number frozen in every chunk the result is the same); merged-away slots are marked dead.

    k, v ``[..., L, D]``; pos ``[..., L]`` int; size ``[..., L]`` float; frozen ``[..., L]`` bool. Returns k, v,
    pos, size and ``live [..., L]`` bool (frozen + ``target`` free slots per chunk are live; order arbitrary)."""
    L = k.shape[-2]
    live = torch.ones_like(frozen)
    big = torch.iinfo(torch.int64).max // 4
    while True:
        free = live & ~frozen
        excess = free.sum(-1) - target  # [...]
        if not bool((excess > 0).any()):
            break
        # free slots first in time order, then frozen, then dead: the partition alternates in time over the free
        key = pos.long() + torch.where(free, 0, torch.where(live, big, 2 * big))
        srt = key.argsort(dim=-1, stable=True)
        k, v = rows(k, srt), rows(v, srt)
        pos, size, frozen, live, free = (x.gather(-1, srt) for x in (pos, size, frozen, live, free))
        ka, kb = k[..., 0::2, :], k[..., 1::2, :]
        fa, fb = free[..., 0::2], free[..., 1::2]
        sim = F.normalize(ka.float(), dim=-1) @ F.normalize(kb.float(), dim=-1).transpose(-1, -2)  # [..., nA, nB]
        sim = sim.masked_fill(~(fa[..., :, None] & fb[..., None, :]), float("-inf"))
        best, dst = sim.max(dim=-1)  # each A slot's most similar free B slot
        rank = best.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        r = torch.minimum(excess.clamp(min=0), fa.sum(-1))  # merges this round, per chunk
        merged = (rank < r[..., None]) & fa  # [..., nA]: the r most similar pairs merge
        sa, sb = size[..., 0::2], size[..., 1::2]
        w = sa * merged  # every A slot, weighted by its size when it merges, 0 when it stays
        new_size = sb.scatter_add(-1, dst, w)
        every_a = torch.arange(ka.shape[-2], device=k.device).expand(dst.shape)
        denom = new_size.clamp(min=1e-6)  # a dead B slot (size 0) receives nothing
        kb = _merge_into(k, every_a, dst, w, sb, denom).to(k.dtype)
        va, vb = v[..., 0::2, :], _merge_into(v, every_a, dst, w, sb, denom).to(v.dtype)
        pa, pb = pos[..., 0::2], pos[..., 1::2]
        pb = pb.scatter_reduce(-1, dst, torch.where(merged, pa, torch.full_like(pa, -1)), reduce="amax")
        k, v = torch.cat([ka, kb], dim=-2), torch.cat([va, vb], dim=-2)
        pos = torch.cat([pa, pb], dim=-1)
        size = torch.cat([sa * ~merged, torch.where(fb | ~live[..., 1::2], new_size, sb)], dim=-1)
        frozen = torch.cat([frozen[..., 0::2], frozen[..., 1::2]], dim=-1)
        live = torch.cat([live[..., 0::2] & ~merged, live[..., 1::2]], dim=-1)
    assert k.shape[-2] == L
    return k, v, pos, size, live


def merge_keep_top(k, v, pos, size, score, protect: int, target: int):
    """:func:`merge_chunks` with the ``protect`` highest-``score`` slots of every chunk kept exact: the other
    ``L - protect`` slots (in time order) merge down to ``target - protect`` centroids.

    k, v ``[..., L, D]`` float; pos ``[..., L]`` int; size, score ``[..., L]`` float; ``protect < target``.
    Returns k, v, pos, size with ``L`` replaced by ``target`` (slots sorted by position)."""
    L = k.shape[-2]
    prot = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(protect, dim=-1).indices, True)
    order = prot.to(torch.int8).argsort(dim=-1, stable=True)  # unprotected first, in time order
    free, keep = order[..., : L - protect], order[..., L - protect :]
    mk, mv, mp, ms = merge_chunks(rows(k, free), rows(v, free), pos.gather(-1, free), size.gather(-1, free),
                                  target - protect)
    mk, mv = torch.cat([mk, rows(k, keep)], -2), torch.cat([mv, rows(v, keep)], -2)
    mp, ms = torch.cat([mp, pos.gather(-1, keep)], -1), torch.cat([ms, size.gather(-1, keep)], -1)
    srt = mp.argsort(dim=-1, stable=True)
    return rows(mk, srt), rows(mv, srt), mp.gather(-1, srt), ms.gather(-1, srt)


def merge_keep_top_context(k, v, pos, size, score, chunks, protect: int, target: int):
    """Protection ranked per KV head over all the chunks of a grid: of row ``b``'s ``chunks[b]`` chunks, the
    ``protect x chunks[b]`` highest-``score`` slots stay exact (at most ``L - (target - protect)`` of one chunk) and
    every chunk merges its other slots down to ``target - protect`` centroids (:func:`merge_free`), so a row and KV
    head holds ``target x chunks[b]`` slots in all, a chunk more or fewer.

    k, v ``[B, H, C, L, D]`` float; pos ``[B, H, C, L]`` int; size, score ``[B, H, C, L]`` float; chunks ``[B]``
    int (chunks ``>= chunks[b]`` of row ``b`` are padding). Returns k, v, pos, size ``[B, H, C, target(, D)]``: a
    row's live slots in time order, packed into its first chunks, pos -1 after them."""
    B, H, C, L, D = k.shape
    K, P = target, protect
    ok = (torch.arange(C, device=k.device)[None, :] < chunks[:, None])[:, None, :, None]  # [B, 1, C, 1]
    elig = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(L - (K - P), dim=-1).indices, True)
    elig &= ok
    flat = score.masked_fill(~elig, float("-inf")).reshape(B, H, C * L)
    rank = flat.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1).view(B, H, C, L)
    prot = elig & (rank < (P * chunks).view(B, 1, 1, 1))
    mk, mv, mp, ms, live = merge_free(k, v, pos, size, prot, K - P)
    live = (live & ok).reshape(B, H, C * L)  # each valid chunk: K live slots; the others none
    key = torch.where(live, mp.reshape(B, H, C * L).long(), torch.iinfo(torch.int64).max)
    srt = key.argsort(dim=-1, stable=True)[..., : C * K]  # live slots in time order, padding rows last
    mk, mv = rows(mk.reshape(B, H, C * L, D), srt), rows(mv.reshape(B, H, C * L, D), srt)
    mp, ms = mp.reshape(B, H, C * L).gather(-1, srt), ms.reshape(B, H, C * L).gather(-1, srt)
    mp = torch.where(live.gather(-1, srt), mp, torch.full_like(mp, -1)).view(B, H, C, K)
    return mk.view(B, H, C, K, D), mv.view(B, H, C, K, D), mp, ms.view(B, H, C, K)


def chunk_grid(pos, first, done, chunks, C: int, L: int):
    """Where each row's next ``chunks`` complete chunks of ``L`` tokens lie among its exact slots.

    pos ``[B, n]`` int: the slots' positions (the same on every KV head), sorted, padding (-1) first; first ``[B]``:
    each row's first real position; done ``[B]``: tokens (from the first real one) merged already; chunks ``[B]``:
    complete chunks to merge, ``C = max(chunks)``. Returns ``grid [B, C * L]`` (slot indices, chunk ``c`` at
    ``c*L .. c*L + L - 1``; a row's chunks past ``chunks[b]`` point at clamped slots the caller masks),
    ``merging [B, n]`` bool (the slots of the grid's valid chunks) and ``real [B, n]`` bool (not padding)."""
    B, n = pos.shape
    rel = pos - first[:, None]
    real = pos >= 0
    merging = real & (rel >= done[:, None]) & (rel < (done + chunks * L)[:, None])
    start = (real & (rel < done[:, None])).sum(-1) + (~real).sum(-1)  # [B]: the first slot to merge
    dev = pos.device
    grid = start[:, None, None] + torch.arange(C, device=dev)[None, :, None] * L + torch.arange(L, device=dev)
    return grid.clamp(max=n - 1).view(B, C * L), merging, real


def take_slots(x, idx):
    """Slots ``idx [B, m]`` (same for every head) of ``x [B, H, n]`` or ``[B, H, n, D]``."""
    B, H = x.shape[:2]
    if x.dim() == 3:
        return x.gather(2, idx[:, None, :].expand(B, H, idx.shape[1]))
    return x.gather(2, idx[:, None, :, None].expand(B, H, idx.shape[1], x.shape[-1]))


def compact_valid(valid):
    """Column order ``[B, m]`` that moves invalid slots to the front (stable) and keeps the last m: the valid
    slots of ``valid [B, n]`` in order, a row with fewer led by invalid ones (``m`` = the most valid in a row)."""
    order = valid.int().argsort(dim=-1, stable=True)
    m = int(valid.sum(-1).max()) if valid.numel() else 0
    return order[:, order.shape[1] - m :]
