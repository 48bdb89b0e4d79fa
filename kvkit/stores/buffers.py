"""The buffers stores write in place: :func:`grow_in_place` (appends into a preallocated buffer with headroom),
:func:`crop_count` (the crop rule every store keeps) and the query rings of static stores (:func:`new_ring`,
:func:`ring_write`, :func:`ring_last`: fixed addresses, written at device positions, no host read)."""

from __future__ import annotations

import torch


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
