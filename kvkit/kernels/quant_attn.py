"""Decode attention straight from int8 / int4 / int2 packed K/V (see ``quant.Packed``), in Triton.

One program per (batch, KV head, split, row tile) holds up to BLOCK_M (<= :data:`MAX_BLOCK_M`) of the G query
heads x Tq tokens of the group as the rows of a ``[BLOCK_M, D]`` tile (a decode step: one tile of G rows; a
multi-token query, e.g. a prefill chunk over packed segments: ceil(G*Tq / BLOCK_M) tiles) and walks the tokens in ``BLOCK_N`` tiles. Each tile of packed codes is
read once as a contiguous ``[BLOCK_N, D*bits/8]`` byte tile (exactly bits/8 bytes per element, plus
the group statistics). Thanks to the split-block packing (byte b holds channels b, b+DB, ...), one
shift + mask yields a contiguous ``[BLOCK_N, DB]`` block of codes, so the dots run per block
(``P = 8/bits`` dots of depth DB = D/P) with no register shuffles. The affine dequantisation is folded
out of the inner loop where the statistics allow it:

* keys, channel-wise, tile inside one token group: ``q.k = sum_d (q_d s_d) code_nd + sum_d q_d z_d``
  (the scaled query per block once per tile, the codes go to the dot as they are);
* values, token-wise, one group per token: ``sum_n p_n v_nd = sum_n (p_n s_n) code_nd + sum_n p_n z_n``;
* channel pre-scales (ZipCache values) multiply the output once at the end (keys: the query).

Other layouts dequantise each block in registers (``code * scale + zero``). No fp16 copy of K or V
is ever written to memory. Online softmax / split-K / reduce as in ``sparse._gather_attn_kernel``
(:mod:`kvkit.kernels.splitk`'s ``online_softmax`` and ``softmax_stats``; K and V are read and the accumulators
kept per channel block, so its tile load, dots and store do not apply here).

Reference: :func:`kvkit.kernels.reference.quant_decode_ref` (dequantize, then dense attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreting, next_pow2
from .splitk import LOG2E, alloc_partials, dot_fp32, finish_splits, online_softmax, plan_splits, softmax_stats


@triton.jit
def _codes(DATA, row, ok, j: tl.constexpr, BITS: tl.constexpr, DB: tl.constexpr):
    """Codes of channel block j (channels j*DB .. j*DB+DB-1) of rows ``row`` as int32 ``[BLOCK_N, DB]``."""
    offs_b = tl.arange(0, DB)
    byte = tl.load(DATA + row[:, None] * DB + offs_b[None, :], mask=ok[:, None], other=0).to(tl.int32)
    return (byte >> (j * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _stats(SCALE, ZERO, bh, N, G, start, tok, ok, j: tl.constexpr, D: tl.constexpr, DB: tl.constexpr,
           CHANNELWISE: tl.constexpr):
    """Scale and zero of block j broadcast to ``[BLOCK_N, DB]`` (general layouts), fp32."""
    offs_c = j * DB + tl.arange(0, DB)
    if CHANNELWISE:
        soff = (bh * tl.cdiv(N, G) + tok[:, None] // G) * D + offs_c[None, :]
    else:
        soff = (bh * N + tok[:, None]) * (D // G) + offs_c[None, :] // G
    sc = tl.load(SCALE + soff, mask=ok[:, None], other=0.0).to(tl.float32)
    zp = tl.load(ZERO + soff, mask=ok[:, None], other=0.0).to(tl.float32)
    return sc, zp


@triton.jit
def _qk_block(q_j, KD, KS, KZ, bh, N, KG, start, tok, ok, row, j: tl.constexpr, K_BITS: tl.constexpr,
              D: tl.constexpr, DB: tl.constexpr, K_CW: tl.constexpr, K_FOLD: tl.constexpr, DOT_FP32: tl.constexpr):
    """Partial scores ``[BLOCK_M, BLOCK_N]`` of channel block j (q_j already multiplied by the pre-scale)."""
    code = _codes(KD, row, ok, j, K_BITS, DB)
    if K_FOLD:  # one stats vector for the whole tile
        offs_c = j * DB + tl.arange(0, DB)
        soff = (bh * tl.cdiv(N, KG) + start // KG) * D + offs_c
        sc = tl.load(KS + soff).to(tl.float32)
        zp = tl.load(KZ + soff).to(tl.float32)
        qs = q_j * sc[None, :]
        bias = tl.sum(q_j * zp[None, :], 1)
        if DOT_FP32:
            s = tl.dot(qs, tl.trans(code.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(qs.to(tl.bfloat16), tl.trans(code.to(tl.bfloat16)))  # codes <= 255: exact in bf16
        return s + bias[:, None]
    sc, zp = _stats(KS, KZ, bh, N, KG, start, tok, ok, j, D, DB, K_CW)
    k = code.to(tl.float32) * sc + zp
    if DOT_FP32:
        return tl.dot(q_j, tl.trans(k), input_precision="ieee")
    return tl.dot(q_j.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))


@triton.jit
def _pv_block(acc_j, p, pw, VD, VS, VZ, bh, N, VG, start, tok, ok, row, j: tl.constexpr, V_BITS: tl.constexpr,
              D: tl.constexpr, DB: tl.constexpr, V_CW: tl.constexpr, V_FOLD: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc_j + p @ V[:, block j] (pw = p * per-token scale when folded)."""
    code = _codes(VD, row, ok, j, V_BITS, DB)
    if V_FOLD:
        if DOT_FP32:
            return acc_j + tl.dot(pw, code.to(tl.float32), input_precision="ieee")
        return acc_j + tl.dot(pw.to(tl.bfloat16), code.to(tl.bfloat16))
    sc, zp = _stats(VS, VZ, bh, N, VG, start, tok, ok, j, D, DB, V_CW)
    v = code.to(tl.float32) * sc + zp
    if DOT_FP32:
        return acc_j + tl.dot(p, v, input_precision="ieee")
    return acc_j + tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))


@triton.jit
def _load_q(Q, KP, bh, q_row, row_ok, j: tl.constexpr, DB: tl.constexpr, D: tl.constexpr, K_PRE: tl.constexpr):
    offs_c = j * DB + tl.arange(0, DB)
    q = tl.load(Q + q_row[:, None] + offs_c[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    if K_PRE:
        q = q * tl.load(KP + bh * D + offs_c).to(tl.float32)[None, :]
    return q


@triton.jit
def _store_block(OP, acc_j, zsum, l_safe, VP, bh, row, row_ok, S, split, j: tl.constexpr, DB: tl.constexpr,
                 D: tl.constexpr, V_PRE: tl.constexpr):
    offs_c = j * DB + tl.arange(0, DB)
    o = (acc_j + zsum[:, None]) / l_safe[:, None]
    if V_PRE:
        o = o * tl.load(VP + bh * D + offs_c).to(tl.float32)[None, :]
    tl.store(OP + (row[:, None] * S + split) * D + offs_c[None, :], o, mask=row_ok[:, None])


@triton.jit
def _quant_attn_kernel(
    Q, KD, KS, KZ, KP, VD, VS, VZ, VP, MASK, OP, LP,
    sqb, sqh, sqt, smb, N, Hkv, Tq, G_KV, KG, VG, S, SPLIT_LEN, qk_scale,
    K_BITS: tl.constexpr, K_CW: tl.constexpr, K_PRE: tl.constexpr, K_FOLD: tl.constexpr,
    V_BITS: tl.constexpr, V_CW: tl.constexpr, V_PRE: tl.constexpr, V_FOLD: tl.constexpr, HAS_MASK: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    KPB: tl.constexpr = 8 // K_BITS  # channel blocks of the keys
    VPB: tl.constexpr = 8 // V_BITS
    DK: tl.constexpr = D // KPB
    DV: tl.constexpr = D // VPB
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // Hkv).to(tl.int64)
    h = pid % Hkv
    bh = b * Hkv + h
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = offs_m // Tq
    t = offs_m % Tq
    row_ok = offs_m < G_KV * Tq
    hq = h * G_KV + g
    q_row = b * sqb + hq * sqh + t * sqt
    # the query, per key channel block, with the key pre-scale folded in (blocks beyond KPB unused)
    q0 = _load_q(Q, KP, bh, q_row, row_ok, 0, DK, D, K_PRE)
    if KPB > 1:
        q1 = _load_q(Q, KP, bh, q_row, row_ok, 1, DK, D, K_PRE)
    if KPB > 2:
        q2 = _load_q(Q, KP, bh, q_row, row_ok, 2, DK, D, K_PRE)
        q3 = _load_q(Q, KP, bh, q_row, row_ok, 3, DK, D, K_PRE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    zsum = tl.zeros([BLOCK_M], tl.float32)  # sum_n p_n zero_n (folded values)
    acc0 = tl.zeros([BLOCK_M, DV], tl.float32)
    acc1 = tl.zeros([BLOCK_M, DV], tl.float32)
    acc2 = tl.zeros([BLOCK_M, DV], tl.float32)
    acc3 = tl.zeros([BLOCK_M, DV], tl.float32)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, N)
    for start in range(lo, lo + SPLIT_LEN, BLOCK_N):  # bounds from scalars only (Triton 3.6 interpreter)
        tok = start + tl.arange(0, BLOCK_N)
        ok = tok < hi
        if HAS_MASK:
            ok = ok & (tl.load(MASK + b * smb + tok, mask=ok, other=0) != 0)
        row = bh * N + tok
        s = _qk_block(q0, KD, KS, KZ, bh, N, KG, start, tok, ok, row, 0, K_BITS, D, DK, K_CW, K_FOLD, DOT_FP32)
        if KPB > 1:
            s += _qk_block(q1, KD, KS, KZ, bh, N, KG, start, tok, ok, row, 1, K_BITS, D, DK, K_CW, K_FOLD, DOT_FP32)
        if KPB > 2:
            s += _qk_block(q2, KD, KS, KZ, bh, N, KG, start, tok, ok, row, 2, K_BITS, D, DK, K_CW, K_FOLD, DOT_FP32)
            s += _qk_block(q3, KD, KS, KZ, bh, N, KG, start, tok, ok, row, 3, K_BITS, D, DK, K_CW, K_FOLD, DOT_FP32)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, alpha, p = online_softmax(s, m_i, l_i)
        if V_FOLD:
            vs = tl.load(VS + row, mask=ok, other=0.0).to(tl.float32)
            vz = tl.load(VZ + row, mask=ok, other=0.0).to(tl.float32)
            pw = p * vs[None, :]
            zsum = zsum * alpha + tl.sum(p * vz[None, :], 1)
        else:
            pw = p
        acc0 = _pv_block(acc0 * alpha[:, None], p, pw, VD, VS, VZ, bh, N, VG, start, tok, ok, row, 0, V_BITS, D, DV,
                         V_CW, V_FOLD, DOT_FP32)
        if VPB > 1:
            acc1 = _pv_block(acc1 * alpha[:, None], p, pw, VD, VS, VZ, bh, N, VG, start, tok, ok, row, 1, V_BITS, D,
                             DV, V_CW, V_FOLD, DOT_FP32)
        if VPB > 2:
            acc2 = _pv_block(acc2 * alpha[:, None], p, pw, VD, VS, VZ, bh, N, VG, start, tok, ok, row, 2, V_BITS, D,
                             DV, V_CW, V_FOLD, DOT_FP32)
            acc3 = _pv_block(acc3 * alpha[:, None], p, pw, VD, VS, VZ, bh, N, VG, start, tok, ok, row, 3, V_BITS, D,
                             DV, V_CW, V_FOLD, DOT_FP32)
    l_safe, lse = softmax_stats(m_i, l_i)
    orow = (b * (Hkv * G_KV) + hq) * Tq + t
    _store_block(OP, acc0, zsum, l_safe, VP, bh, orow, row_ok, S, split, 0, DV, D, V_PRE)
    if VPB > 1:
        _store_block(OP, acc1, zsum, l_safe, VP, bh, orow, row_ok, S, split, 1, DV, D, V_PRE)
    if VPB > 2:
        _store_block(OP, acc2, zsum, l_safe, VP, bh, orow, row_ok, S, split, 2, DV, D, V_PRE)
        _store_block(OP, acc3, zsum, l_safe, VP, bh, orow, row_ok, S, split, 3, DV, D, V_PRE)
    tl.store(LP + orow * S + split, lse, mask=row_ok)


TUNING = {"block_n": 64, "num_warps": 4, "num_stages": 3}  # best of bench --sweep on an H100 (results/speed-gpu/h100-kernels-2026-11-23)
#: the most query rows (G heads x Tq tokens) one program holds: more rows go to more programs (grid axis 2). One
#: tile of all the rows of a long prefill chunk (4096 rows: 1024 tokens at G = 4) does not fit a GPU's shared
#: memory (the H100 failure: results/speed-gpu/h100-llama-3.2-1b-b16-16k-2026-11-26/log.txt)
MAX_BLOCK_M = 64


def _parts(p):
    pre = p.prescale.float().contiguous() if p.prescale is not None else p.scale
    return p.data.contiguous(), p.scale.contiguous(), p.zero.contiguous(), pre


def quant_decode_triton(q4, kpack, vpack, *, scale, mask=None, num_splits=None, block_n=None):
    """Launcher. q4 ``[B, Hq, Tq, D]``; kpack/vpack pack ``[B, Hkv, N, D]``; mask ``[B, N]`` bool.
    D/(8/bits) must be a power of two >= 16 for both packs (``kvkit.kernels.packed._quant_supported``).
    Returns out ``[B, Hq, Tq, D]`` (q dtype) and lse ``[B, Hq, Tq]`` fp32."""
    B, Hq, Tq, D = q4.shape
    _, Hkv, N, _ = kpack.shape
    if q4.dtype == torch.float64:
        q4 = q4.float()
    q4 = q4 if q4.stride(-1) == 1 else q4.contiguous()
    G = Hq // Hkv
    BLOCK_M = min(MAX_BLOCK_M, max(16, next_pow2(G * Tq)))
    m_tiles = triton.cdiv(G * Tq, BLOCK_M)
    if block_n is None:
        block_n = 16 if interpreting() else TUNING["block_n"]
    S, split_len = plan_splits(N, block_n, B * Hkv, q4.device, num_splits)
    R = B * Hq * Tq
    op, lp = alloc_partials(R, S, D, q4.device)
    if mask is not None:
        mask = mask.to(torch.uint8).contiguous()
    kd, ks, kz, kp = _parts(kpack)
    vd, vs, vz, vp = _parts(vpack)
    k_fold = kpack.axis == -2 and kpack.group_size % block_n == 0
    v_fold = vpack.axis == -1 and vpack.group_size == D
    _quant_attn_kernel[(B * Hkv, S, m_tiles)](
        q4, kd, ks, kz, kp, vd, vs, vz, vp, mask if mask is not None else q4, op, lp,
        q4.stride(0), q4.stride(1), q4.stride(2), mask.stride(0) if mask is not None else 0,
        N, Hkv, Tq, G, kpack.group_size, vpack.group_size, S, split_len, float(scale) * LOG2E,
        K_BITS=kpack.bits, K_CW=kpack.axis == -2, K_PRE=kpack.prescale is not None, K_FOLD=k_fold,
        V_BITS=vpack.bits, V_CW=vpack.axis == -2, V_PRE=vpack.prescale is not None, V_FOLD=v_fold,
        HAS_MASK=mask is not None, D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, DOT_FP32=dot_fp32(q4.dtype),
        num_warps=1 if interpreting() else TUNING["num_warps"], num_stages=1 if interpreting() else TUNING["num_stages"],
    )
    out = torch.empty(B, Hq, Tq, D, device=q4.device, dtype=q4.dtype)
    lse = torch.empty(B, Hq, Tq, device=q4.device, dtype=torch.float32)
    finish_splits(op, lp, out.view(R, D), lse.view(R), S, D)
    return out, lse
