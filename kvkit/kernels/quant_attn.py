"""Decode attention straight from int8 / int4 / int2 packed K/V (see ``quant.Packed``), in Triton.

One program per (batch, KV head, split) holds the G query heads x Tq tokens of the group as the rows
of a ``[BLOCK_M, D]`` tile; each ``BLOCK_N``-token tile of the packed codes is loaded once (exactly
bits/8 bytes per element, plus the group statistics), unpacked with shifts and masks and dequantised in
registers (``q * scale + zero`` [* channel pre-scale]), then fed to the same online-softmax / split-K /
reduce scheme as ``sparse._gather_attn_kernel``. No fp16 copy of K or V is ever written to memory.

Reference: :func:`kvkit.kernels.reference.quant_decode_ref` (dequantize, then dense attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreting, next_pow2
from .sparse import LOG2E, dot_fp32, finish_splits, pick_splits


@triton.jit
def _dequant_tile(DATA, SCALE, ZERO, PRE, bh, N, G, start, tok, ok, offs_d,
                  D: tl.constexpr, BITS: tl.constexpr, CHANNELWISE: tl.constexpr, HAS_PRE: tl.constexpr,
                  STAT_VEC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dequantised ``[BLOCK_N, D]`` fp32 tile of rows ``tok`` of one (batch, head) slice ``bh``.

    The codes are read as a contiguous ``[BLOCK_N, D*BITS/8]`` byte tile (vector loads, each byte once)
    and unpacked with shifts + ``tl.join`` / ``tl.reshape`` (channel d sits at bits (d % (8/BITS))*BITS
    of byte d // (8/BITS)). STAT_VEC: the tile's statistics are one vector (keys: the whole tile lies in
    one token group; values: one group per token) instead of a ``[BLOCK_N, D]`` gather."""
    PPB: tl.constexpr = 8 // BITS
    DB: tl.constexpr = D // PPB
    offs_b = tl.arange(0, DB)
    byte = tl.load(DATA + (bh * N + tok[:, None]) * DB + offs_b[None, :], mask=ok[:, None], other=0).to(tl.int32)
    if BITS == 8:
        code = byte
    elif BITS == 4:
        code = tl.reshape(tl.join(byte & 15, byte >> 4), [BLOCK_N, D])
    else:
        lo = tl.join(byte & 3, (byte >> 4) & 3)
        hi = tl.join((byte >> 2) & 3, (byte >> 6) & 3)
        code = tl.reshape(tl.join(lo, hi), [BLOCK_N, D])
    m2 = ok[:, None]
    if CHANNELWISE:  # stats per channel, groups of G tokens: [.., ceil(N/G), D]
        if STAT_VEC:
            soff = (bh * tl.cdiv(N, G) + start // G) * D + offs_d
            sc = tl.load(SCALE + soff).to(tl.float32)[None, :]
            zp = tl.load(ZERO + soff).to(tl.float32)[None, :]
        else:
            soff = (bh * tl.cdiv(N, G) + tok[:, None] // G) * D + offs_d[None, :]
            sc = tl.load(SCALE + soff, mask=m2, other=0.0).to(tl.float32)
            zp = tl.load(ZERO + soff, mask=m2, other=0.0).to(tl.float32)
    else:  # stats per token, groups of G channels: [.., N, D/G]
        if STAT_VEC:
            soff = bh * N + tok
            sc = tl.load(SCALE + soff, mask=ok, other=0.0).to(tl.float32)[:, None]
            zp = tl.load(ZERO + soff, mask=ok, other=0.0).to(tl.float32)[:, None]
        else:
            soff = (bh * N + tok[:, None]) * (D // G) + offs_d[None, :] // G
            sc = tl.load(SCALE + soff, mask=m2, other=0.0).to(tl.float32)
            zp = tl.load(ZERO + soff, mask=m2, other=0.0).to(tl.float32)
    x = code.to(tl.float32) * sc + zp
    if HAS_PRE:
        x = x * tl.load(PRE + bh * D + offs_d).to(tl.float32)[None, :]
    return x


@triton.jit
def _quant_attn_kernel(
    Q, KD, KS, KZ, KP, VD, VS, VZ, VP, MASK, OP, LP,
    sqb, sqh, sqt, smb, N, Hkv, Tq, G_KV, KG, VG, S, SPLIT_LEN, qk_scale,
    K_BITS: tl.constexpr, K_CW: tl.constexpr, K_PRE: tl.constexpr, K_VEC: tl.constexpr,
    V_BITS: tl.constexpr, V_CW: tl.constexpr, V_PRE: tl.constexpr, V_VEC: tl.constexpr, HAS_MASK: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // Hkv).to(tl.int64)
    h = pid % Hkv
    bh = b * Hkv + h
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    g = offs_m // Tq
    t = offs_m % Tq
    row_ok = offs_m < G_KV * Tq
    d_ok = offs_d < D
    hq = h * G_KV + g
    q = tl.load(Q + b * sqb + hq[:, None] * sqh + t[:, None] * sqt + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, N)
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        ok = tok < hi
        if HAS_MASK:
            ok = ok & (tl.load(MASK + b * smb + tok, mask=ok, other=0) != 0)
        k = _dequant_tile(KD, KS, KZ, KP, bh, N, KG, start, tok, ok, offs_d, D, K_BITS, K_CW, K_PRE, K_VEC, BLOCK_N)
        v = _dequant_tile(VD, VS, VZ, VP, bh, N, VG, start, tok, ok, offs_d, D, V_BITS, V_CW, V_PRE, V_VEC, BLOCK_N)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row = (b * (Hkv * G_KV) + hq) * Tq + t
    tl.store(OP + (row[:, None] * S + split) * D + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LP + row * S + split, lse, mask=row_ok)


TUNING = {"block_n": 64, "num_warps": 4, "num_stages": 3}  # H100 defaults (bench --sweep)


def supported(D: int) -> bool:
    """The Triton path unpacks whole rows: head_dim must be a power of two >= 16 (else: reference)."""
    return D >= 16 and D & (D - 1) == 0


def _stat_vec(p, block_n):
    if p.axis == -2:
        return p.group_size % block_n == 0
    return p.group_size == p.shape[-1]


def _parts(p):
    pre = p.prescale.float().contiguous() if p.prescale is not None else p.scale
    return p.data.contiguous(), p.scale.contiguous(), p.zero.contiguous(), pre


def quant_decode_triton(q4, kpack, vpack, *, scale, mask=None, num_splits=None, block_n=None):
    """Launcher. q4 ``[B, Hq, Tq, D]``; kpack/vpack pack ``[B, Hkv, N, D]``; mask ``[B, N]`` bool.
    Returns out ``[B, Hq, Tq, D]`` (q dtype) and lse ``[B, Hq, Tq]`` fp32."""
    B, Hq, Tq, D = q4.shape
    _, Hkv, N, _ = kpack.shape
    if q4.dtype == torch.float64:
        q4 = q4.float()
    q4 = q4 if q4.stride(-1) == 1 else q4.contiguous()
    G = Hq // Hkv
    BLOCK_M = max(16, next_pow2(G * Tq))
    BLOCK_D = D  # the byte tile is unpacked to exactly D channels (power of two, checked by the caller)
    if block_n is None:
        block_n = 16 if interpreting() else TUNING["block_n"]
    n_tiles = triton.cdiv(max(N, 1), block_n)
    S = num_splits if num_splits is not None else pick_splits(B * Hkv, n_tiles, q4.device)
    S = max(1, min(int(S), n_tiles))
    split_len = triton.cdiv(triton.cdiv(max(N, 1), S), block_n) * block_n
    S = triton.cdiv(max(N, 1), split_len)
    R = B * Hq * Tq
    op = torch.empty(R, S, D, device=q4.device, dtype=torch.float32)
    lp = torch.empty(R, S, device=q4.device, dtype=torch.float32)
    if mask is not None:
        mask = mask.to(torch.uint8).contiguous()
    kd, ks, kz, kp = _parts(kpack)
    vd, vs, vz, vp = _parts(vpack)
    _quant_attn_kernel[(B * Hkv, S)](
        q4, kd, ks, kz, kp, vd, vs, vz, vp, mask if mask is not None else q4, op, lp,
        q4.stride(0), q4.stride(1), q4.stride(2), mask.stride(0) if mask is not None else 0,
        N, Hkv, Tq, G, kpack.group_size, vpack.group_size, S, split_len, float(scale) * LOG2E,
        K_BITS=kpack.bits, K_CW=kpack.axis == -2, K_PRE=kpack.prescale is not None, K_VEC=_stat_vec(kpack, block_n),
        V_BITS=vpack.bits, V_CW=vpack.axis == -2, V_PRE=vpack.prescale is not None, V_VEC=_stat_vec(vpack, block_n),
        HAS_MASK=mask is not None,
        D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=BLOCK_D, DOT_FP32=dot_fp32(q4.dtype),
        num_warps=1 if interpreting() else TUNING["num_warps"], num_stages=1 if interpreting() else TUNING["num_stages"],
    )
    out = torch.empty(B, Hq, Tq, D, device=q4.device, dtype=q4.dtype)
    lse = torch.empty(B, Hq, Tq, device=q4.device, dtype=torch.float32)
    finish_splits(op, lp, out.view(R, D), lse.view(R), S, D)
    return out, lse
