"""The split-K (flash-decoding) pieces shared by the Triton decode kernels (``sparse``, ``lowrank``, ``quant_attn``,
``fused_decode``).

A phase-1 program walks its split of a key list in ``BLOCK_N`` tiles and keeps, per query row, the running
maximum ``m`` and sum ``l`` of an online softmax in log2 space (exp2, fp32) and an fp32 accumulator ``acc``;
it writes a partial (out, lse) to ``OP [R, S, D]`` / ``LP [R, S]`` (R = flat query rows, S = splits), and phase 2
(``_reduce_kernel``, :func:`finish_splits`) combines the S partials of each row by log-sum-exp.

Device side (``@triton.jit``, inlined into the calling kernel):

* :func:`softmax_init`: the empty state (m = -inf, l = 0, acc = 0).
* :func:`load_kv`: a tile of K and V rows read in place at given row ids (masked rows read nothing).
* :func:`qk_scores`: ``q @ k^T`` (IEEE fp32 dot or a tensor-core dot in q's dtype).
* :func:`add_log_weight`: an additive per-key log-weight (natural log) added to log2-unit scores.
* :func:`online_softmax`: one tile's update of ``m``, ``l``; gives the rescale ``alpha`` and the weights ``p``.
* :func:`accumulate`: ``acc * alpha + p @ v`` (IEEE fp32 dot or a tensor-core dot in v's dtype).
* :func:`softmax_stats`: the final guarded ``l`` and the natural-log lse of a row.
* :func:`store_partial`: normalise ``acc`` and store one split's partial (out, lse).

Host side: :func:`pick_splits` / :func:`plan_splits` (the split count and length), :func:`alloc_partials`,
:func:`finish_splits` (phase 2), :func:`dot_fp32` (which dot a launch uses).

Like the kernel modules, this one imports Triton at import time, so it is imported only when a Triton launch is
requested (see :mod:`kvkit.kernels._triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreting, next_pow2, num_sms

LOG2E = 1.4426950408889634  # scores are scaled by scale * LOG2E so the kernels can use exp2


@triton.jit
def softmax_init(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The state before the first tile: ``m_i = -inf``, ``l_i = 0`` ``[BLOCK_M]`` and ``acc = 0``
    ``[BLOCK_M, BLOCK_D]``, all fp32."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def load_kv(k_base, v_base, rows, skn, svn, ok, offs_d, d_ok):
    """K and V tiles ``[BLOCK_N, BLOCK_D]`` (input dtype): row ``rows[n]`` (stride skn / svn from the bases, last dim
    contiguous) where ``ok[n]``, zeros elsewhere (a masked row is never dereferenced)."""
    kv_mask = ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + rows[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + rows[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def qk_scores(q, k, DOT_FP32: tl.constexpr):
    """``q @ k^T``: q ``[BLOCK_M, BLOCK_D]``, k ``[BLOCK_N, BLOCK_D]`` -> ``[BLOCK_M, BLOCK_N]`` fp32. DOT_FP32: k in
    fp32 and an IEEE fp32 dot (q already fp32); else k cast to q's dtype (tensor cores)."""
    if DOT_FP32:
        return tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k.to(q.dtype)))


@triton.jit
def add_log_weight(s, W, ok):
    """``s [BLOCK_M, BLOCK_N]`` (log2 units) plus the per-key weights at the pointers ``W [BLOCK_N]`` (natural log,
    times LOG2E); a key that is not ``ok`` adds 0 (and is not read)."""
    w = tl.load(W, mask=ok, other=0.0).to(tl.float32)
    return s + w[None, :] * 1.4426950408889634


@triton.jit
def online_softmax(s, m_i, l_i):
    """One tile of the online softmax. ``s [BLOCK_M, BLOCK_N]``: scores already in log2 units (scale * LOG2E,
    plus any bias * LOG2E) with excluded keys at -inf; ``m_i``, ``l_i [BLOCK_M]``: the running max and sum.

    Returns ``(m_new, l_new, alpha, p)``: the new max and sum, ``alpha = exp2(m_i - m_new) [BLOCK_M]`` (rescales
    what was accumulated so far) and ``p = exp2(s - m_new) [BLOCK_M, BLOCK_N]``. A row whose max is still -inf
    (no key seen) uses 0 as its max, so it gets ``alpha = p = 0`` instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, l_new, alpha, p


@triton.jit
def accumulate(acc, alpha, p, v, DOT_FP32: tl.constexpr):
    """``acc * alpha[:, None] + p @ v``: acc ``[BLOCK_M, BLOCK_D]`` fp32, p ``[BLOCK_M, BLOCK_N]`` fp32, v
    ``[BLOCK_N, BLOCK_D]``. DOT_FP32: v in fp32 and an IEEE fp32 dot; else p cast to v's dtype (tensor cores)."""
    if DOT_FP32:
        return acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def softmax_stats(m_i, l_i):
    """End of a split: ``(l_safe, lse)`` per row. ``l_safe`` is ``l_i`` where positive, else 1 (the divisor of the
    accumulator: a row that saw no key keeps its zeros); ``lse = (m_i + log2 l_i) * ln 2`` (natural log) or -inf
    for such a row."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return l_safe, lse


@triton.jit
def store_partial(OP, LP, acc, m_i, l_i, row, row_ok, offs_d, d_ok, S, split, D: tl.constexpr):
    """Store split ``split`` of the rows ``row [BLOCK_M]`` (flat query-row ids, masked by ``row_ok``): out =
    ``acc / l`` to ``OP[row, split, :D]`` (cast to OP's element type; OP ``[R, S, D]`` contiguous) and the lse
    of :func:`softmax_stats` to ``LP[row, split]`` (LP ``[R, S]``). With S = 1, OP/LP may be the final out/lse."""
    l_safe, lse = softmax_stats(m_i, l_i)
    out = acc / l_safe[:, None]
    tl.store(OP + (row[:, None] * S + split) * D + offs_d[None, :], out.to(OP.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
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


def pick_splits(n_programs: int, n_tiles: int, device) -> int:
    """Split-K factor: enough programs for ~4 waves of the SMs, at least 2 tiles per split."""
    if n_tiles <= 1:
        return 1
    sms = num_sms(device.index or 0) if device.type == "cuda" else 4
    want = max(1, (4 * sms + n_programs - 1) // n_programs)
    return max(1, min(want, n_tiles // 2 if n_tiles >= 4 else 1, 64))


def plan_splits(L: int, block_n: int, n_programs: int, device, num_splits=None) -> tuple[int, int]:
    """Split a key list of length L (walked in ``block_n`` tiles by ``n_programs`` programs per split) into
    ``(S, split_len)``: S = ``num_splits`` or :func:`pick_splits`, clamped to [1, tiles]; ``split_len`` = L / S
    rounded up to a multiple of ``block_n``; S recomputed so that no split is empty (S * split_len >= L).
    An empty list (L = 0) is planned as one split of one tile."""
    n = max(L, 1)
    n_tiles = triton.cdiv(n, block_n)
    S = num_splits if num_splits is not None else pick_splits(n_programs, n_tiles, device)
    S = max(1, min(int(S), n_tiles))
    split_len = triton.cdiv(triton.cdiv(n, S), block_n) * block_n
    return triton.cdiv(n, split_len), split_len


def alloc_partials(R: int, S: int, D: int, device):
    """Phase-1 outputs: ``op [R, S, D]`` and ``lp [R, S]``, fp32, uninitialised (phase 1 writes every entry)."""
    return (torch.empty(R, S, D, device=device, dtype=torch.float32),
            torch.empty(R, S, device=device, dtype=torch.float32))


def finish_splits(op, lp, out, lse, S, D):
    """Second pass: partial ``op [R, S, D]``, ``lp [R, S]`` -> ``out [R, D]`` (out dtype), ``lse [R]``."""
    R = lp.shape[0]
    _reduce_kernel[(R,)](op, lp, out, lse, S, D=D, BLOCK_S=max(2, next_pow2(S)), BLOCK_D=next_pow2(D),
                         num_warps=1 if interpreting() else 4)


def dot_fp32(dtype) -> bool:
    """fp32 (IEEE) dots under the interpreter (no bf16 dot there) and for fp32/fp64 inputs."""
    return interpreting() or dtype not in (torch.float16, torch.bfloat16)
