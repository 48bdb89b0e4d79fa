"""CPU decode attention that reads only what a policy selects: small C kernels, the CPU paths of ShadowKV's
low-rank decode (:func:`lowrank_attn`) and of TidalDecode's sparse reads (:func:`sparse_attn`).

The torch paths copy before they attend: :func:`kvkit.kernels.reference.lowrank_decode_ref` gathers the selected
tokens' rows of ``U``, multiplies them by ``S*V^T`` into a float key tensor, gathers a cos and a sin row per key and
rotates, and TidalDecode's ``gather_attend`` copies the selected K/V rows into buffers with ``index_select``:
intermediate tensors the size of the selected keys are written and read back per layer and step.
``lowrank_attn`` rebuilds each selected key in registers -- ``k = U[tok] @ (S*V^T)[head]`` (the ``r x D`` factor
of the head stays in L1, a register-blocked GEMM over blocks of 4 tokens), RoPE at its position from the
half-width table rows -- dots it with the ``M`` query rows of its KV head and never stores it; exact parts
(outliers, local window) join the same softmax. ``sparse_attn`` reads each listed K/V row in place. Both:
one softmax (a vectorised exp), the values' weighted sum with each row read once for the query rows of its head
(scattered rows prefetched), one OpenMP task per (batch row, head, [token]) with ``torch.get_num_threads()``
threads. Written with GCC/Clang vector extensions (AVX-512 registers under ``-march=native`` where the machine
has them); fp32 only.

Compiled on first use by :func:`kvkit.kernels.cbuild.build`; without a C compiler :func:`available` is False
and the callers keep their torch paths. ``KVKIT_DECODE_CPU=0`` disables both kernels.
"""

from __future__ import annotations

import ctypes

import torch

from .cbuild import VEC_C, Kernel, c_source

_SRC = VEC_C + c_source("decode_cpu.c")

P, I64, Int, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_KERNEL = Kernel("decode_cpu", _SRC, {
    "kvkit_lowrank_attn": ([P, P, P, P, P, P, P, P, P, Int, I64, I64, I64, I64, Int, Int, Int, F, Int, P, P, P, P, P,
                            P, P, P, P, P, P, Int], Int),
    "kvkit_sparse_attn": ([P, P, P, I64, I64, P, P, I64, I64, I64, I64, I64, Int, Int, F, P, P, Int], Int),
}, "KVKIT_DECODE_CPU")
_load = _KERNEL.load


def available() -> bool:
    """True when the kernel is built (or builds now) and not disabled by ``KVKIT_DECODE_CPU=0``."""
    return _KERNEL.available()


def supported(q: torch.Tensor, U: torch.Tensor, SV: torch.Tensor, v: torch.Tensor) -> bool:
    """For :func:`lowrank_attn`: fp32 CPU tensors, contiguous factors and values, head width <= 512."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (q, U, SV, v))
            and U.is_contiguous() and SV.is_contiguous() and v.is_contiguous() and SV.shape[-1] <= 512)


def lowrank_attn(q4, U, SV, v, tok, scale, cos_half, sin_half, *, position_offset=None, positions=None, exact=()):
    """Attention of one query token per row, ``q4 [B, Hq, 1, D]``, over the keys rebuilt from ``U [B, N, r]`` and
    ``SV [B, Hkv, r, D]`` at token ids ``tok [B, Hkv, K]`` (-1 = none; int64), RoPE'd at ``position_offset[b] +
    tok`` (``[B]``) or ``positions [B, N]``, with the rotate_half tables' first halves ``cos_half/sin_half
    [P, Dr/2]`` (rows = positions; attention scaling included), and values ``v [B, Hkv, N, D]`` at the same ids;
    plus up to 4 ``exact`` parts ``(keys, values, pos)``: keys/values ``[B, Hkv, n, D]`` (rows contiguous, same
    strides), pos ``[B, Hkv or 1, n]`` int32 (< 0: not read; the query sees every other slot), all in one
    softmax. Returns (out ``[B, Hq, 1, D]`` fp32, lse ``[B, Hq, 1]`` fp32; a row with no key: zeros and -inf)."""
    lib = _load()
    B, Hq, T, D = q4.shape
    H, N, r = SV.shape[1], U.shape[1], U.shape[2]
    K = tok.shape[-1]
    M = (Hq // H) * T
    qf = q4.reshape(B, H, M, D).contiguous()
    tok = tok.to(torch.int64).contiguous()
    cos_half, sin_half = cos_half.contiguous(), sin_half.contiguous()
    off = None if position_offset is None else position_offset.to(torch.int64).contiguous()
    pos = None if positions is None else positions.to(torch.int64).contiguous()
    parts = [(k, vv, p) for k, vv, p in exact if k.shape[-2] > 0]
    if len(parts) > 4:
        raise ValueError("kvkit.kernels.decode_cpu.lowrank_attn: at most 4 exact parts")
    n = len(parts)
    ek, ev, ep, en = (P * n)(), (P * n)(), (P * n)(), (I64 * n)()
    sb, sh, psb, psh = (I64 * n)(), (I64 * n)(), (I64 * n)(), (I64 * n)()
    for i, (k, vv, p) in enumerate(parts):
        if (k.dtype != torch.float32 or vv.dtype != torch.float32 or k.stride() != vv.stride() or k.stride(-1) != 1
                or k.stride(-2) != D or p.dtype != torch.int32 or p.stride(-1) != 1):
            raise ValueError("kvkit.kernels.decode_cpu.lowrank_attn: exact parts must be fp32 keys/values with "
                             "contiguous rows and equal strides, and int32 positions")
        p = p.expand(B, H, p.shape[-1])
        ek[i], ev[i], ep[i], en[i] = k.data_ptr(), vv.data_ptr(), p.data_ptr(), k.shape[-2]
        sb[i], sh[i], psb[i], psh[i] = k.stride(0), k.stride(1), p.stride(0), p.stride(1)
    lds = K + sum(int(k.shape[-2]) for k, _, _ in parts)
    scratch = torch.empty(B * H * M * max(lds, 1), dtype=torch.float32)
    out = torch.empty(B, H, M, D, dtype=torch.float32)
    lse = torch.empty(B, H, M, dtype=torch.float32)
    with torch.profiler.record_function("kvkit::lowrank_attn_cpu"):
        rc = lib.kvkit_lowrank_attn(
            qf.data_ptr(), U.data_ptr(), SV.data_ptr(), v.data_ptr(), tok.data_ptr(),
            None if off is None else off.data_ptr(), None if pos is None else pos.data_ptr(),
            cos_half.data_ptr(), sin_half.data_ptr(), cos_half.shape[-1], B, H, N, K, M, r, D, float(scale),
            n, ek, ev, ep, en, sb, sh, psb, psh, scratch.data_ptr(), out.data_ptr(), lse.data_ptr(),
            max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit decode_cpu kernel refused shapes B={B} H={H} M={M} D={D} r={r}")
    return out.view(B, Hq, T, D), lse.view(B, Hq, T)


def rows_view(x: torch.Tensor):
    """``x [B, H, n, D]`` (last dim contiguous, rows of one head equally spaced, heads equally spaced, e.g. a
    prefix of a preallocated buffer) as a ``[rows, D]`` view and the row stride of a head (``cap``): row
    ``(b*H + h)*cap + i`` is ``x[b, h, i]``. Copies only when the layout does not allow a view."""
    B, H, n, D = x.shape
    s0, s1, s2, s3 = x.stride()
    if not (s3 == 1 and s2 == D and s1 % D == 0 and s0 == H * s1):
        x = x.contiguous()
        s1 = n * D
    cap = s1 // D
    rows = (B * H - 1) * cap + n
    return x.as_strided((rows, D), (D, 1)), cap


def sparse_attn(query, keys, values, idx, valid, scale):
    """Attention of each query token over its own listed K/V rows, read in place (TidalDecode's reuse layers).

    query ``[B, Hq, T, D]`` fp32; keys/values ``[B, H, n, D]`` fp32 (rows contiguous; a prefix of a larger buffer
    is read in place); idx ``[B, Hs, T, L]`` slot indices in ``[0, n)`` with Hs = Hq (one list per query head) or
    Hs = H (one per KV head, shared by its query group); valid ``[B, Hs, T, L]`` bool or None. Returns
    ``[B, T, Hq, D]`` fp32 (a list with no valid entry reads zeros)."""
    lib = _load()
    B, Hq, T, D = query.shape
    H = keys.shape[1]
    Hs, L = idx.shape[1], idx.shape[-1]
    G = Hq // Hs
    kr, kcap = rows_view(keys)
    vr, vcap = rows_view(values)
    q = query.reshape(B, Hs, G, T, D).transpose(2, 3).contiguous()  # [B, Hs, T, G, D]
    ids = idx.to(torch.int64).contiguous()
    ok = None if valid is None else valid.to(torch.uint8).contiguous()
    scratch = torch.empty(B * Hs * T * G * max(L, 1), dtype=torch.float32)
    out = torch.empty(B, Hs, T, G, D, dtype=torch.float32)
    with torch.profiler.record_function("kvkit::sparse_attn_cpu"):
        rc = lib.kvkit_sparse_attn(q.data_ptr(), kr.data_ptr(), vr.data_ptr(), kcap, vcap, ids.data_ptr(),
                                   None if ok is None else ok.data_ptr(), B, H, Hs, T, L, G, D, float(scale),
                                   scratch.data_ptr(), out.data_ptr(), max(1, torch.get_num_threads()))
    if rc != 0:
        raise RuntimeError(f"kvkit decode_cpu sparse kernel refused shapes B={B} H={H} Hs={Hs} G={G} D={D}")
    return out.permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
