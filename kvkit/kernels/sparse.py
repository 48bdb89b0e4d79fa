"""Sparse decode attention (gathered tokens), flash-decoding style, in Triton.

Kernel: ``_gather_attn_kernel`` -- one program per (batch, index list, split). An index list belongs to
a KV head (``index_mode='kv_head'``: the program holds all G = Hq/Hkv query heads of the group x the
Tq query tokens as the rows of one ``[BLOCK_M, D]`` tile, so each K/V row is loaded once per group) or
to one query head (``'q_head'``). The list is walked in ``BLOCK_N`` tiles with an online softmax
(exp2, fp32 statistics); with split-K each program covers one slice of the list and writes a partial
(out, lse) that ``_reduce_kernel`` combines. Every load is masked: entries that are -1, out of
``[0, N)`` or masked by ``valid`` contribute nothing and are never dereferenced.

Modes (constexpr): 0 dense (token = position in the list, used by ``weighted_decode``), 1 token
indices (``sparse_decode``, TidalDecode's reuse layers). Optional additive bias ``[B, Hkv, N]`` and key mask
``[B, N]``.

Reference: :func:`kvkit.kernels.reference.sparse_decode_ref` (``dense_decode_ref`` for mode 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreting, next_pow2, num_sms

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

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
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + tok[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + tok[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if HAS_BIAS:
            bias = tl.load(BIAS + b * sbb + hkv * sbh + tok, mask=ok, other=0.0).to(tl.float32)
            s = s + bias[None, :] * 1.4426950408889634
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row = (b * (Hidx * GH) + hq) * Tq + t  # flat (b, hq, t)
    o_ptrs = OP + (row[:, None] * S + split) * D + offs_d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LP + row * S + split, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(OP, LP, OUT, LSE, S, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combine S partial (out, lse) of one (b, hq, t) row: flash-decoding's second pass."""
    row = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < S
    lse = tl.load(LP + row * S + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    tot = tl.sum(w, 0)
    o = tl.load(OP + (row * S + offs_s[:, None]) * D + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(tot > 0, tot, 1.0)
    tl.store(OUT + row * D + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < D)
    tl.store(LSE + row, tl.where(tot > 0, m_safe + tl.log(tl.where(tot > 0, tot, 1.0)), float("-inf")))


TUNING = {"block_n": 32, "num_warps": 4, "num_stages": 2}  # best of bench --sweep on an H100 (results/kernels)


def pick_splits(n_programs: int, n_tiles: int, device) -> int:
    """Split-K factor: enough programs for ~4 waves of the SMs, at least 2 tiles per split."""
    if n_tiles <= 1:
        return 1
    sms = num_sms(device.index or 0) if device.type == "cuda" else 4
    want = max(1, (4 * sms + n_programs - 1) // n_programs)
    return max(1, min(want, n_tiles // 2 if n_tiles >= 4 else 1, 64))


def finish_splits(op, lp, out, lse, S, D):
    """Second pass: partial ``op [R, S, D]``, ``lp [R, S]`` -> ``out [R, D]`` (out dtype), ``lse [R]``."""
    R = lp.shape[0]
    _reduce_kernel[(R,)](op, lp, out, lse, S, D=D, BLOCK_S=max(2, next_pow2(S)), BLOCK_D=next_pow2(D),
                         num_warps=1 if interpreting() else 4)


def dot_fp32(dtype) -> bool:
    """fp32 (IEEE) dots under the interpreter (no bf16 dot there) and for fp32/fp64 inputs."""
    return interpreting() or dtype not in (torch.float16, torch.bfloat16)


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
    n_tiles = triton.cdiv(max(L, 1), block_n)
    S = num_splits if num_splits is not None else pick_splits(n_prog, n_tiles, q4.device)
    S = max(1, min(int(S), n_tiles))
    split_len = triton.cdiv(triton.cdiv(max(L, 1), S), block_n) * block_n
    S = triton.cdiv(max(L, 1), split_len)
    R = B * Hq * Tq
    op = torch.empty(R, S, D, device=q4.device, dtype=torch.float32)
    lp = torch.empty(R, S, device=q4.device, dtype=torch.float32)
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
