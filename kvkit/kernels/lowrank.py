"""ShadowKV decode: keys rebuilt from low-rank pre-RoPE factors + RoPE + attention, fused in Triton.

One program per (batch, KV head, [query token,] split) walks the selected chunks in ``BLOCK_N``-token
tiles. For each tile it gathers the rows ``U[b, tok, :]`` (rank r, shared by the heads) and multiplies
them by the head's ``SV[b, h] [r, D]`` in ``BLOCK_R`` slices -- twice: once with SV's columns as they
are (the pre-RoPE key) and once with the columns permuted and negated as ``rotate_half`` would (so no
register shuffles are needed); cos/sin come from the original positions and ``inv_freq`` in fp32 (HF
convention, times ``attention_scaling``). The rebuilt post-RoPE key tile never leaves registers; the
values are gathered from the value store (or read in order when already gathered), then the same
online-softmax / split-K / reduce as ``sparse._gather_attn_kernel`` (:mod:`kvkit.kernels.splitk`).

Reference: :func:`kvkit.kernels.reference.lowrank_decode_ref` / :func:`~kvkit.kernels.reference.reconstruct_keys`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreting, next_pow2
from .splitk import (
    LOG2E,
    accumulate,
    alloc_partials,
    dot_fp32,
    finish_splits,
    online_softmax,
    plan_splits,
    qk_scores,
    softmax_init,
    store_partial,
)


@triton.jit
def _lowrank_attn_kernel(
    Q, U, SV, V, IDX, POS, INV, MASK, OP, LP,
    sqb, sqh, sqt, sub, sun, ssb, ssh, ssr, svb, svh, svn, sib, sih, sit, spb, smb,
    N, R, L, Hkv, Ti, Tq, G_KV, S, SPLIT_LEN, qk_scale, rope_scale,
    CS: tl.constexpr, DR: tl.constexpr, POS_MODE: tl.constexpr, V_GATHERED: tl.constexpr,
    HAS_MASK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // (Hkv * Ti)).to(tl.int64)
    h = (pid // Ti) % Hkv
    ti = pid % Ti
    TT = Tq // Ti
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r0 = tl.arange(0, BLOCK_R)
    g = offs_m // TT
    t = ti + offs_m % TT
    row_ok = offs_m < G_KV * TT
    d_ok = offs_d < D
    hq = h * G_KV + g
    q = tl.load(Q + b * sqb + hq[:, None] * sqh + t[:, None] * sqt + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # rotate_half as a column permutation of SV: rh(x)[d] = -x[d + DR/2] (d < DR/2), x[d - DR/2] (d < DR)
    HALF: tl.constexpr = DR // 2
    rot = offs_d < DR
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    inv = tl.load(INV + offs_d % HALF, mask=rot, other=0.0).to(tl.float32)
    sv_base = SV + b * ssb + h * ssh
    v_base = V + b * svb + h * svh
    i_base = IDX + b * sib + h * sih + ti * sit

    m_i, l_i, acc = softmax_init(BLOCK_M, BLOCK_D)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, L)
    for start in range(lo, lo + SPLIT_LEN, BLOCK_N):  # bounds from scalars only (Triton 3.6 interpreter)
        offs = start + tl.arange(0, BLOCK_N)
        in_list = offs < hi
        cid = tl.load(i_base + offs // CS, mask=in_list, other=-1).to(tl.int64)
        tok = tl.where(cid >= 0, cid * CS + offs % CS, -1)
        ok = in_list & (tok >= 0) & (tok < N)
        if HAS_MASK:
            ok = ok & (tl.load(MASK + b * smb + tok, mask=ok, other=0) != 0)
        tok = tl.where(ok, tok, 0)
        k_pre = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        k_rh = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + offs_r0
            r_ok = offs_r < R
            u = tl.load(U + b * sub + tok[:, None] * sun + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
            sv = tl.load(sv_base + offs_r[:, None] * ssr + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                         other=0.0)
            svr = tl.load(sv_base + offs_r[:, None] * ssr + partner[None, :], mask=r_ok[:, None] & rot[None, :],
                          other=0.0)
            if DOT_FP32:
                u = u.to(tl.float32)
                k_pre += tl.dot(u, sv.to(tl.float32), input_precision="ieee")
                k_rh += tl.dot(u, svr.to(tl.float32), input_precision="ieee")
            else:
                k_pre += tl.dot(u, sv)
                k_rh += tl.dot(u, svr)
        if POS_MODE == 1:  # explicit positions [B, N]
            pos = tl.load(POS + b * spb + tok, mask=ok, other=0).to(tl.float32)
        elif POS_MODE == 2:  # offset [B] + row
            pos = (tl.load(POS + b) + tok).to(tl.float32)
        else:
            pos = tok.to(tl.float32)
        ang = pos[:, None] * inv[None, :]
        cos = tl.where(rot[None, :], tl.cos(ang) * rope_scale, 1.0)
        sin = tl.where(rot[None, :], tl.sin(ang) * rope_scale, 0.0)
        k = k_pre * cos + k_rh * sign[None, :] * sin
        if V_GATHERED:
            vrow = ti * L + offs
        else:
            vrow = tok
        v = tl.load(v_base + vrow[:, None] * svn + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.where(ok[None, :], qk_scores(q, k, DOT_FP32) * qk_scale, float("-inf"))
        m_i, l_i, alpha, p = online_softmax(s, m_i, l_i)
        acc = accumulate(acc, alpha, p, v, DOT_FP32)
    row = (b * (Hkv * G_KV) + hq) * Tq + t
    store_partial(OP, LP, acc, m_i, l_i, row, row_ok, offs_d, d_ok, S, split, D)


TUNING = {"block_n": 64, "num_warps": 8, "num_stages": 2}  # best of bench --sweep on an H100 (results/speed-gpu/h100-kernels-2026-11-23)


def lowrank_decode_triton(q4, U, SV, v, idx, chunk_size, inv_freq, *, positions=None, position_offset=None,
                          attention_scaling=1.0, v_gathered=False, scale, mask=None, num_splits=None,
                          block_n=None):
    """Launcher. q4 ``[B, Hq, Tq, D]``; U ``[B, N, r]``; SV ``[B, Hkv, r, D]``; v ``[B, Hkv, N, D]`` (or
    gathered ``[B, Hkv, Ti*L, D]``); idx chunk ids ``[B, Hkv, Ti, C]``; inv_freq ``[Dr/2]``.
    Returns out ``[B, Hq, Tq, D]``, lse ``[B, Hq, Tq]`` fp32."""
    B, Hq, Tq, D = q4.shape
    N, R = U.shape[1], U.shape[2]
    Hkv = SV.shape[1]
    if q4.dtype == torch.float64:
        q4, v = q4.float(), v.float()
    if U.dtype == torch.float64:
        U, SV = U.float(), SV.float()
    if not dot_fp32(q4.dtype) and U.dtype != q4.dtype:  # tensor-core dots need one operand dtype
        U, SV = U.to(q4.dtype), SV.to(q4.dtype)
    U, SV, v = U.contiguous(), SV.contiguous(), v.contiguous()
    q4 = q4 if q4.stride(-1) == 1 else q4.contiguous()
    idx = idx.contiguous()
    inv = inv_freq.float().contiguous()
    Ti = idx.shape[2]
    L = idx.shape[3] * chunk_size
    G = Hq // Hkv
    TT = Tq // Ti
    BLOCK_M = max(16, next_pow2(G * TT))
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_R = 16 if interpreting() or R <= 16 else 32
    if block_n is None:
        block_n = 16 if interpreting() else TUNING["block_n"]
    S, split_len = plan_splits(L, block_n, B * Hkv * Ti, q4.device, num_splits)
    if positions is not None:
        pos_mode, pos_t, spb = 1, positions.contiguous(), N
    elif position_offset is not None:
        pos_mode, pos_t, spb = 2, position_offset.to(torch.int64).contiguous(), 0
    else:
        pos_mode, pos_t, spb = 0, idx, 0
    if mask is not None:
        mask = mask.to(torch.uint8).contiguous()
    Rr = B * Hq * Tq
    op, lp = alloc_partials(Rr, S, D, q4.device)
    _lowrank_attn_kernel[(B * Hkv * Ti, S)](
        q4, U, SV, v, idx, pos_t, inv, mask if mask is not None else q4, op, lp,
        q4.stride(0), q4.stride(1), q4.stride(2), U.stride(0), U.stride(1), SV.stride(0), SV.stride(1),
        SV.stride(2), v.stride(0), v.stride(1), v.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
        spb, mask.stride(0) if mask is not None else 0,
        N, R, L, Hkv, Ti, Tq, G, S, split_len, float(scale) * LOG2E, float(attention_scaling),
        CS=chunk_size, DR=2 * inv.shape[0], POS_MODE=pos_mode, V_GATHERED=bool(v_gathered),
        HAS_MASK=mask is not None, D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=BLOCK_D, BLOCK_R=BLOCK_R,
        DOT_FP32=dot_fp32(q4.dtype), num_warps=1 if interpreting() else TUNING["num_warps"],
        num_stages=1 if interpreting() else TUNING["num_stages"],
    )
    out = torch.empty(B, Hq, Tq, D, device=q4.device, dtype=q4.dtype)
    lse = torch.empty(B, Hq, Tq, device=q4.device, dtype=torch.float32)
    finish_splits(op, lp, out.view(Rr, D), lse.view(Rr), S, D)
    return out, lse
