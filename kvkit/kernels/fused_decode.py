"""One fused split-K (flash-decoding) Triton kernel for the decode seam (:class:`kvkit.kernels.DecodeView`).

Kernel ``_fused_decode_kernel``: one program per (row b, KV head h, split). The program holds the G = Hq/H
query heads of the KV head as the rows of one ``[BLOCK_M, D]`` tile, so each K/V row is read once per KV head.
Its split covers positions ``[split * SPLIT_LEN, (split + 1) * SPLIT_LEN)`` of the read list (the slot ids
of ``index``, or the slots ``0 .. cap-1`` themselves), walked in ``BLOCK_N`` tiles with an online softmax
(exp2, fp32 statistics). Constexpr switches select what the view carries:

* ``HAS_LEN``: ``length[b, h]`` (or ``length[b]``) loaded once; slots ``>= length`` are masked, and without
  an index the loop also stops at the length, so free capacity is neither loaded nor computed on.
* ``HAS_INDEX``: slot ids loaded per tile and gathered in place (-1 / out of ``[0, cap)`` read nothing).
* ``HAS_POS``: ``pos[b, h or 0, slot]`` loaded per tile; a slot is read only when ``0 <= pos <= qpos[b]``.
* ``HAS_LW``: ``log_weight[b, h, slot]`` added to the score (natural-log units; -inf hides the key).

Every load is masked; a slot that fails a test is never dereferenced. Phase 1 writes a partial (out, lse)
per split; phase 2 (``splitk._reduce_kernel``) merges the splits by log-sum-exp. With one split the kernel
writes the final output directly and phase 2 is skipped. The number of splits is a function of the shapes
and of the device's SM count only (never of device values), so a launch is CUDA-graph capturable. A row/head
that sees no key gets zeros and lse = -inf.

Reference: :func:`kvkit.kernels.reference.decode_ref` (:func:`~kvkit.kernels.reference.dense_view_ref` for
one view's own keys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as _ref
from ._triton import interpreting, next_pow2
from .quant_attn import quant_decode_triton
from .splitk import (
    LOG2E,
    accumulate,
    add_log_weight,
    alloc_partials,
    dot_fp32,
    finish_splits,
    load_kv,
    online_softmax,
    plan_splits,
    qk_scores,
    softmax_init,
    store_partial,
)


@triton.jit
def _fused_decode_kernel(
    Q, K, V, LEN, IDX, POS, QPOS, LW, OP, LP,
    sqb, sqh, skb, skh, skn, svb, svh, svn,
    slb, slh, sib, sih, spb, sph, sqp, swb, swh,
    CAP, L, H, G, S, SPLIT_LEN, qk_scale,
    HAS_LEN: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_POS: tl.constexpr, HAS_LW: tl.constexpr,
    TRIM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H).to(tl.int64)  # int64 offsets: stores past 2**31 elements
    h = (pid % H).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < G
    d_ok = offs_d < D
    hq = h * G + offs_m
    q = tl.load(Q + b * sqb + hq[:, None] * sqh + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh

    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, L)  # end of this split in the read list
    if HAS_LEN:
        held = tl.load(LEN + b * slb + h * slh).to(tl.int32)
        if not HAS_INDEX:
            hi = tl.minimum(hi, held)  # list position == slot: stop at the held slots
    if HAS_POS:
        qp = tl.load(QPOS + b * sqp).to(tl.int64)

    m_i, l_i, acc = softmax_init(BLOCK_M, BLOCK_D)
    if TRIM:
        end = hi
    else:
        end = lo + SPLIT_LEN
    for start in range(lo, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        ok = offs < hi
        if HAS_INDEX:
            slot = tl.load(IDX + b * sib + h * sih + offs, mask=ok, other=-1).to(tl.int64)
            ok = ok & (slot >= 0) & (slot < CAP)
            if HAS_LEN:
                ok = ok & (slot < held)
        else:
            slot = offs.to(tl.int64)
        if HAS_POS:
            p = tl.load(POS + b * spb + h * sph + slot, mask=ok, other=-1).to(tl.int64)
            ok = ok & (p >= 0) & (p <= qp)
        slot = tl.where(ok, slot, 0)
        k, v = load_kv(k_base, v_base, slot, skn, svn, ok, offs_d, d_ok)
        s = qk_scores(q, k, DOT_FP32) * qk_scale
        if HAS_LW:
            s = add_log_weight(s, LW + b * swb + h * swh + slot, ok)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_i, l_i, alpha, pr = online_softmax(s, m_i, l_i)
        acc = accumulate(acc, alpha, pr, v, DOT_FP32)

    row = b * (H * G) + hq  # flat (b, hq)
    store_partial(OP, LP, acc, m_i, l_i, row, row_ok, offs_d, d_ok, S, split, D)


TUNING = {"block_n": 64, "block_n_index": 32, "num_warps": 4, "num_stages": 2}


def _dynamic_loop_bounds() -> bool:
    """Loop end from a loaded length (skips free capacity): compiled Triton always; the interpreter from 3.9 on
    (older interpreters need scalar loop bounds; the masks give the same result either way)."""
    if not interpreting():
        return True
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9)


def _last_contig(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def fused_decode_triton(q3, view, *, scale, num_splits=None, block_n=None):
    """Launcher for one view's own keys (its parts are not read here).

    q3 ``[B, Hq, D]``; view.k / view.v ``[B, H, cap, D]`` (checked by ``view.check_view``).
    Returns out ``[B, Hq, D]`` (q3's dtype) and lse ``[B, Hq]`` fp32.
    """
    B, Hq, D = q3.shape
    k, v = view.k, view.v
    H, cap = k.shape[1], k.shape[2]
    L = view.index.shape[2] if view.index is not None else cap
    out_dtype = q3.dtype
    if L == 0 or cap == 0 or B * Hq == 0:  # shapes only: nothing to read
        return q3.new_zeros(B, Hq, D), torch.full((B, Hq), float("-inf"), dtype=torch.float32, device=q3.device)
    if q3.dtype == torch.float64:  # Triton dots are at most fp32
        q3, k, v = q3.float(), k.float(), v.float()
    q3, k, v = _last_contig(q3), _last_contig(k), _last_contig(v)
    length, index, pos, lw = (_last_contig(view.length), _last_contig(view.index), _last_contig(view.pos),
                              _last_contig(view.log_weight))
    qpos = view.qpos
    G = Hq // H
    BLOCK_M = max(16, next_pow2(G))
    BLOCK_D = max(16, next_pow2(D))
    if block_n is None:
        block_n = 16 if interpreting() else TUNING["block_n_index" if index is not None else "block_n"]
    S, split_len = plan_splits(L, block_n, B * H, q3.device, num_splits)
    R = B * Hq
    out = torch.empty(B, Hq, D, device=q3.device, dtype=q3.dtype)
    lse = torch.empty(B, Hq, device=q3.device, dtype=torch.float32)
    # with one split the kernel writes the result itself
    op, lp = (out, lse) if S == 1 else alloc_partials(R, S, D, q3.device)
    dummy = q3  # pointer for absent tensors (never loaded: their constexpr switch is off)
    sl = (length.stride(0), length.stride(1) if length.dim() == 2 else 0) if length is not None else (0, 0)
    si = (index.stride(0), index.stride(1)) if index is not None else (0, 0)
    sp = (pos.stride(0), pos.stride(1) if pos.shape[1] > 1 else 0) if pos is not None else (0, 0)
    sq = (qpos.stride(0) if qpos.dim() == 1 and qpos.shape[0] > 1 else 0) if qpos is not None else 0
    sw = (lw.stride(0), lw.stride(1)) if lw is not None else (0, 0)
    _fused_decode_kernel[(B * H, S)](
        q3, k, v,
        length if length is not None else dummy, index if index is not None else dummy,
        pos if pos is not None else dummy, qpos if qpos is not None else dummy, lw if lw is not None else dummy,
        op, lp,
        q3.stride(0), q3.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *sl, *si, *sp, sq, *sw,
        cap, L, H, G, S, split_len, float(scale) * LOG2E,
        HAS_LEN=length is not None, HAS_INDEX=index is not None, HAS_POS=pos is not None, HAS_LW=lw is not None,
        TRIM=_dynamic_loop_bounds(), D=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=BLOCK_D,
        DOT_FP32=dot_fp32(q3.dtype),
        num_warps=1 if interpreting() else TUNING["num_warps"], num_stages=1 if interpreting() else TUNING["num_stages"],
    )
    if S > 1:
        finish_splits(op, lp, out.view(R, D), lse.view(R), S, D)
    return out.to(out_dtype), lse


def _quant_triton_ok(D, bits):
    db = D // (8 // bits)
    return db >= 16 and db & (db - 1) == 0


def packed_part_triton(q3, part, *, scale, num_splits=None):
    """A :class:`kvkit.kernels.view.PackedPart` through ``quant_attn``'s Triton kernel (codes unpacked in
    registers) where its layout fits (D/(8/bits) a power of two >= 16), else the reference.
    q3 ``[B, Hq, D]`` -> out ``[B, Hq, D]``, lse ``[B, Hq]``."""
    if not (_quant_triton_ok(q3.shape[-1], part.k.bits) and _quant_triton_ok(q3.shape[-1], part.v.bits)):
        out, lse = _ref.packed_part_ref(q3, part, scale=scale)
        return out, lse.float()
    N = part.k.shape[-2]
    mask = None
    if part.length is not None:
        mask = torch.arange(N, device=q3.device)[None, :] < part.length[:, None]  # [B, N], fixed shape
    out, lse = quant_decode_triton(q3[:, :, None], part.k, part.v, scale=scale, mask=mask, num_splits=num_splits)
    return out[:, :, 0].to(q3.dtype), lse[:, :, 0]


def decode_triton(q3, view, *, scale, num_splits=None):
    """The Triton path of :func:`kvkit.kernels.decode`: the view's own keys through the fused kernel, each part
    through its kernel, merged by log-sum-exp. q3 ``[B, Hq, D]`` -> out ``[B, Hq, D]``, lse ``[B, Hq]`` fp32."""
    res = []
    if view.k is not None:
        res.append(fused_decode_triton(q3, view, scale=scale, num_splits=num_splits))
    for part in view.parts:
        if part.kind == "dense":
            res.append(decode_triton(q3, part, scale=scale, num_splits=num_splits))
        elif part.kind == "packed":
            res.append(packed_part_triton(q3, part, scale=scale, num_splits=num_splits))
        else:
            raise ValueError(f"kvkit.kernels.decode: cannot read a view part of type {type(part).__name__}")
    out, lse = res[0]
    for o, s in res[1:]:
        out, lse = _ref.merge_attn(out, lse, o, s)
    return out, lse
