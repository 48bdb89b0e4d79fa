"""Sparse decode attention (gathered tokens), flash-decoding style, in Triton.

Kernel: ``_gather_attn_kernel`` -- one program per (batch, index list, split). An index list belongs to
a KV head (``index_mode='kv_head'``: the program holds all G = Hq/Hkv query heads of the group x the
Tq query tokens as the rows of one ``[BLOCK_M, D]`` tile, so each K/V row is loaded once per group) or
to one query head (``'q_head'``). The list is walked in ``BLOCK_N`` tiles with an online softmax
(exp2, fp32 statistics); with split-K each program covers one slice of the list and writes a partial
(out, lse) that phase 2 combines (the split-K pieces shared by the kernels: :mod:`kvkit.kernels.splitk`). Every
load is masked: entries that are -1, out of ``[0, N)`` or masked by ``valid`` contribute nothing and are never
dereferenced.

Modes (constexpr): 0 dense (token = position in the list, used by ``weighted_decode``), 1 token
indices (``sparse_decode``, TidalDecode's reuse layers). Optional additive bias ``[B, Hkv, N]`` and key mask
``[B, N]``.

Reference: :func:`kvkit.kernels.reference.sparse_decode_ref` (``dense_decode_ref`` for mode 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreting, next_pow2
from .splitk import (
    LOG2E,
    accumulate,
    add_log_weight,
    alloc_partials,
    dot_fp32,
    finish_splits,
    load_kv,
    online_softmax,
    pick_splits,  # noqa: F401 -- re-exported: its home was this module
    plan_splits,
    qk_scores,
    softmax_init,
    store_partial,
)


@triton.jit
def _gather_attn_kernel(
    Q, K, V, IDX, BIAS, MASK, OP, LP,
    sqb, sqh, sqt, skb, skh, skn, svb, svh, svn, sib, sih, sit, sbb, sbh, smb,
    N, L, Hidx, Ti, Tq, GH, RATIO, S, SPLIT_LEN, qk_scale,
    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // (Hidx * Ti)).to(tl.int64)  # int64 offsets: stores past 2**31 elements
    hi = (pid // Ti) % Hidx
    ti = pid % Ti
    hkv = hi // RATIO
    TT = Tq // Ti  # query tokens per program: all Tq (shared list) or 1 (per-token list)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    g = offs_m // TT
    t = ti + offs_m % TT
    row_ok = offs_m < GH * TT
    d_ok = offs_d < D
    hq = hi * GH + g
    q_ptrs = Q + b * sqb + hq[:, None] * sqh + t[:, None] * sqt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    k_base = K + b * skb + hkv * skh
    v_base = V + b * svb + hkv * svh
    i_base = IDX + b * sib + hi * sih + ti * sit

    m_i, l_i, acc = softmax_init(BLOCK_M, BLOCK_D)
    lo = split * SPLIT_LEN
    hi_end = tl.minimum(lo + SPLIT_LEN, L)
    for start in range(lo, lo + SPLIT_LEN, BLOCK_N):  # bounds from scalars only (Triton 3.6 interpreter)
        offs = start + tl.arange(0, BLOCK_N)
        in_list = offs < hi_end
        if MODE == 0:
            tok = offs
        else:
            tok = tl.load(i_base + offs, mask=in_list, other=-1).to(tl.int64)
        ok = in_list & (tok >= 0) & (tok < N)
        if HAS_MASK:
            ok = ok & (tl.load(MASK + b * smb + tok, mask=ok, other=0) != 0)
        tok = tl.where(ok, tok, 0)
        k, v = load_kv(k_base, v_base, tok, skn, svn, ok, offs_d, d_ok)
        s = qk_scores(q, k, DOT_FP32) * qk_scale
        if HAS_BIAS:
            s = add_log_weight(s, BIAS + b * sbb + hkv * sbh + tok, ok)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_i, l_i, alpha, p = online_softmax(s, m_i, l_i)
        acc = accumulate(acc, alpha, p, v, DOT_FP32)

    row = (b * (Hidx * GH) + hq) * Tq + t  # flat (b, hq, t)
    store_partial(OP, LP, acc, m_i, l_i, row, row_ok, offs_d, d_ok, S, split, D)


TUNING = {"block_n": 32, "num_warps": 4, "num_stages": 2}  # best of bench --sweep on an H100 (results/speed-gpu/h100-kernels-2026-11-23)


def gather_attn(q4, k, v, idx, *, mode, scale, mask=None, bias=None, num_splits=None, block_n=None):
    """Launcher. q4 ``[B, Hq, Tq, D]``; k, v ``[B, Hkv, N, D]`` (last dim contiguous); idx canonical
    ``[B, Hidx, Ti, L]`` (mode 1: token ids) or None (mode 0, L = N); mask ``[B, N]`` bool;
    bias ``[B, Hkv, N]``. Returns out ``[B, Hq, Tq, D]`` (q dtype), lse ``[B, Hq, Tq]`` fp32."""
    B, Hq, Tq, D = q4.shape
    Hkv, N = k.shape[1], k.shape[2]
    q4 = q4 if q4.stride(-1) == 1 else q4.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if q4.dtype == torch.float64:  # Triton dots are at most fp32
        q4, k, v = q4.float(), k.float(), v.float()
    if mode == 0:
        Hidx, Ti, L = Hkv, 1, N
        idx_t, si = q4, (0, 0, 0)  # unused pointer
    else:
        idx_t = idx if idx.stride(-1) == 1 else idx.contiguous()
        Hidx, Ti = idx_t.shape[1], idx_t.shape[2]
        L = idx_t.shape[3]
        si = (idx_t.stride(0), idx_t.stride(1), idx_t.stride(2))
    GH = Hq // Hidx
    RATIO = Hidx // Hkv
    TT = Tq // Ti
    BLOCK_M = max(16, next_pow2(GH * TT))
    BLOCK_D = max(16, next_pow2(D))
    if block_n is None:
        block_n = 16 if interpreting() else (TUNING["block_n"] if BLOCK_D <= 128 and BLOCK_M <= 16 else 32)
    n_prog = B * Hidx * Ti
    S, split_len = plan_splits(L, block_n, n_prog, q4.device, num_splits)
    R = B * Hq * Tq
    op, lp = alloc_partials(R, S, D, q4.device)
    if bias is not None:
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    if mask is not None:
        mask = mask.to(torch.uint8) if mask.dtype == torch.bool else mask
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    bias_t = bias if bias is not None else q4
    mask_t = mask if mask is not None else q4
    _gather_attn_kernel[(n_prog, S)](
        q4, k, v, idx_t, bias_t, mask_t, op, lp,
        q4.stride(0), q4.stride(1), q4.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *si,
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        mask.stride(0) if mask is not None else 0,
        N, L, Hidx, Ti, Tq, GH, RATIO, S, split_len, float(scale) * LOG2E,
        MODE=mode, HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
        D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=BLOCK_D, DOT_FP32=dot_fp32(q4.dtype),
        num_warps=1 if interpreting() else TUNING["num_warps"], num_stages=1 if interpreting() else TUNING["num_stages"],
    )
    out = torch.empty(B, Hq, Tq, D, device=q4.device, dtype=q4.dtype)
    lse = torch.empty(B, Hq, Tq, device=q4.device, dtype=torch.float32)
    finish_splits(op, lp, out.view(R, D), lse.view(R), S, D)
    return out, lse
