"""Attention of each query token over its own gathered rows of a KV layer (TidalDecode's reuse layers): the
backend choice for that read lives here, with the other kernels' (Triton :func:`kvkit.kernels.sparse_decode` on
CUDA, the C kernel :func:`kvkit.kernels.decode_cpu.sparse_attn` on the CPU in fp32, blocked torch gathers
elsewhere, one plain torch gather inside a compiled step)."""

from __future__ import annotations

import torch

from . import decode_cpu
from .dispatch import use_triton
from .selected import sparse_decode

GATHER_BYTES = 1 << 21  # torch path: gathered K/V per block of batch rows (cache-sized)


def gather_attend(query, keys, values, idx, valid, scaling, bufs=None):
    """Attention of each query token over its own gathered rows.

    query ``[B, Hq, T, D]``; keys/values ``[B, H, n, D]``; idx ``[B, Hs, T, L]`` slot indices (int) with
    Hs = Hq (one list per query head, read from KV head ``h // G``) or Hs = H (one list per KV head, shared
    by its query group); valid ``[B, Hs, T, L]`` bool or None (every entry a real slot). Only the indexed rows
    are read. On CUDA: :func:`kvkit.kernels.sparse_decode` (Triton). On the CPU in fp32:
    :func:`kvkit.kernels.decode_cpu.sparse_attn` (C, rows read in place). Elsewhere, a few batch rows at a time
    (``GATHER_BYTES`` of gathered K/V, so they are still in cache when read back), the rows are copied with
    ``index_select`` into ``bufs`` (a dict reused across calls; new buffers when None) and attended with two
    batched matmuls and an fp32 softmax. Returns ``[B, T, Hq, D]``.
    """
    B, Hq, T, D = query.shape
    H = keys.shape[1]
    Hs, L = idx.shape[1], idx.shape[-1]
    if torch.compiler.is_compiling():
        return gather_attend_torch(query, keys, values, idx, valid, scaling)
    if use_triton(query, keys, values, idx):
        mode = "kv_head" if Hs == H else "q_head"
        ind = idx if valid is None else torch.where(valid, idx, -1)
        return sparse_decode(query, keys, values, ind.to(torch.int32), scale=scaling, index_mode=mode).transpose(1, 2)
    if (query.device.type == "cpu" and query.dtype == keys.dtype == values.dtype == torch.float32
            and keys.shape[-1] == values.shape[-1] and decode_cpu.available()):
        return decode_cpu.sparse_attn(query, keys, values, idx, valid, scaling)  # rows read in place (C kernel)
    Gq, Dv = Hq // Hs, values.shape[-1]  # query heads per list
    kr, cap = decode_cpu.rows_view(keys)
    vr, vcap = decode_cpu.rows_view(values)
    base = (torch.arange(B, device=idx.device).view(B, 1) * H
            + torch.arange(Hs, device=idx.device).view(1, Hs) // (Hs // H)).view(B, Hs, 1, 1)
    flat = (idx + base * cap).view(B, -1)
    vflat = flat if vcap == cap else (idx + base * vcap).view(B, -1)
    per_row = Hs * T * L * (D + Dv) * keys.element_size()
    nb = max(1, min(B, GATHER_BYTES // max(per_row, 1)))
    M = nb * Hs * T * L
    key_ = (query.device, keys.dtype, M, D, Dv)
    bk = None if bufs is None else bufs.get(key_)
    if bk is None:
        bk = (keys.new_empty(M, D), values.new_empty(M, Dv))
        if bufs is not None:
            bufs.clear()  # one live shape at a time (shapes change only with T, the batch or the budget)
            bufs[key_] = bk
    # queries: [B, Hs*T, Gq, D], row (hs*T + t, g) = query head hs*Gq + g at token t
    q = query.reshape(B, Hs, Gq, T, D).transpose(2, 3).reshape(B * Hs * T, Gq, D).to(keys.dtype)
    ok = None if valid is None else valid.reshape(B * Hs * T, 1, L)
    out = torch.empty(B * Hs * T, Gq, Dv, dtype=values.dtype, device=query.device)
    for b0 in range(0, B, nb):
        b1 = min(B, b0 + nb)
        r0, r1, m = b0 * Hs * T, b1 * Hs * T, (b1 - b0) * Hs * T * L
        kg = torch.index_select(kr, 0, flat[b0:b1].reshape(-1), out=bk[0][:m]).view(r1 - r0, L, D)
        vg = torch.index_select(vr, 0, vflat[b0:b1].reshape(-1), out=bk[1][:m]).view(r1 - r0, L, Dv)
        s = torch.bmm(q[r0:r1], kg.transpose(1, 2)).float().mul_(scaling)  # [rows, Gq, L]
        if ok is not None:
            s.masked_fill_(~ok[r0:r1], float("-inf"))
        p = torch.softmax(s, dim=-1)
        if ok is not None:
            p = torch.nan_to_num(p, nan=0.0)  # a list with no real entry reads zeros
        torch.bmm(p.to(vg.dtype), vg, out=out[r0:r1])
    return out.view(B, Hs, T, Gq, Dv).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, Dv).to(query.dtype)


def gather_attend_torch(query, keys, values, idx, valid, scaling):
    """:func:`gather_attend` in plain torch, one gather of every listed row (no kernel, no loop, no buffer reuse):
    what a compiled step traces. Same arguments and result ``[B, T, Hq, D]``; keys/values must be contiguous."""
    B, Hq, T, D = query.shape
    H, cap = keys.shape[1], keys.shape[2]
    Hs, L, Dv = idx.shape[1], idx.shape[-1], values.shape[-1]
    Gq = Hq // Hs  # query heads per list
    base = (torch.arange(B, device=idx.device).view(B, 1) * H
            + torch.arange(Hs, device=idx.device).view(1, Hs) // (Hs // H)).view(B, Hs, 1, 1)
    flat = (idx + base * cap).reshape(-1)
    kg = keys.reshape(-1, D).index_select(0, flat).view(B * Hs * T, L, D)
    vg = values.reshape(-1, Dv).index_select(0, flat).view(B * Hs * T, L, Dv)
    q = query.reshape(B, Hs, Gq, T, D).transpose(2, 3).reshape(B * Hs * T, Gq, D).to(keys.dtype)
    s = torch.bmm(q, kg.transpose(1, 2)).float() * scaling  # [rows, Gq, L]
    if valid is not None:
        s = s.masked_fill(~valid.reshape(B * Hs * T, 1, L), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)  # a list with no real entry reads zeros
    out = torch.bmm(p.to(vg.dtype), vg)
    return out.view(B, Hs, T, Gq, Dv).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, Dv).to(query.dtype)
