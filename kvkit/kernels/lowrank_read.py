"""ShadowKV's reads: keys rebuilt from low-rank pre-RoPE factors at the selected chunks, RoPE'd at their positions
and attended with their values (:func:`lowrank_decode`: Triton on CUDA, the torch reference elsewhere, an opaque
operator inside a compiled step), and the single-token CPU step through the C kernel (:func:`lowrank_token_decode`)."""

from __future__ import annotations

import torch

from . import decode_cpu
from . import reference as _ref
from ._common import check_indices, check_range, check_tensor, check_valid, debug, default_scale, fail
from .dispatch import on_device, use_triton
from .reference import merge_attn
from .selected import finish, weighted_decode


def lowrank_decode(q, U, SV, v, chunk_ids, chunk_size, inv_freq, *, positions=None, position_offset=None,
                   attention_scaling=1.0, v_gathered=False, extra_k=None, extra_v=None, extra_valid=None,
                   scale=None, valid=None, return_lse=False, num_splits=None, rope_table=None):
    """ShadowKV decode: keys of the selected chunks rebuilt from low-rank pre-RoPE factors, RoPE'd at
    their original positions, attended together with their values (fused in one Triton kernel).

    q ``[B, Hq, D]`` or ``[B, Hq, Tq, D]``; U ``[B, N, r]`` (shared across heads); SV ``[B, Hkv, r, D]``;
    v values ``[B, Hkv, N, D]`` indexed by token row, or with ``v_gathered=True`` ``[B, Hkv, Ti*C*chunk_size, D]``
    already in selection order; chunk_ids ``[B, Hkv, C]`` or ``[B, Hkv, Tq, C]`` (per query token), -1 = none;
    inv_freq ``[Dr/2]`` (fp32, Dr <= D rotary dims, HF rotate_half convention, cos/sin multiplied by
    ``attention_scaling``); positions ``[B, N]`` int (original position of each row) or position_offset
    ``[B]`` (position = offset + row; default row). extra_k/extra_v ``[B, Hkv, E, D]``: exact post-RoPE
    keys (outliers, local window, generated tokens) attended jointly; extra_valid ``[B]`` lengths or
    ``[B, E]`` mask. valid (``[B]`` / ``[B, N]``) masks rows of U. Returns out (q's shape) [+ lse].
    rope_table: optional ``(cos, sin)``, each ``[P, Dr]`` fp32 on q's device, row p = the rotation at position p
    (attention scaling included; e.g. the model's rotary module at ``arange(P)``), P above every position
    read: the torch path gathers its rows instead of evaluating cos/sin per selected key (same values);
    the Triton path evaluates cos/sin from inv_freq in registers and does not read it. inv_freq may be None
    when rope_table is given (the torch path then runs on every device). rope_table may also be a zero-argument
    callable returning the pair: it is called only when the torch path runs.
    """
    fn = "lowrank_decode"
    check_tensor(fn, "q", q, (3, 4), (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    q4 = q.unsqueeze(2) if q.dim() == 3 else q
    if torch.compiler.is_compiling():  # one opaque operator that picks its path when the graph runs
        return _lowrank_traced(q, q4, U, SV, v, chunk_ids, chunk_size, inv_freq, positions, position_offset,
                               attention_scaling, v_gathered, extra_k, extra_v, extra_valid, scale, valid,
                               return_lse, rope_table)
    B, Hq, Tq, D = q4.shape
    check_tensor(fn, "U", U, 3, None, q.device)
    check_tensor(fn, "SV", SV, 4, None, q.device)
    check_tensor(fn, "v", v, 4, None, q.device)
    fused = inv_freq is not None and use_triton(q, U, SV, v)
    rope_table = _lowrank_rope(fn, q, inv_freq, rope_table, fused)
    N, Hkv = _lowrank_factors(fn, q, U, SV, v, inv_freq, rope_table)
    idx = check_indices(fn, chunk_ids, B, Hq, Hkv, Tq, "kv_head", q.device, name="chunk_ids")
    _lowrank_values(fn, v, idx, chunk_size, v_gathered, B, Hkv, N, D)
    _lowrank_positions(fn, positions, position_offset, B, N, q.device)
    mask = check_valid(fn, valid, B, N, q.device)
    scale = default_scale(scale, D)
    if debug():
        check_range(fn, "chunk_ids", idx, -(-N // chunk_size))
    if fused:
        from .lowrank import lowrank_decode_triton

        with on_device(q):
            out, lse = lowrank_decode_triton(q4, U, SV, v, idx, chunk_size, inv_freq, positions=positions,
                                             position_offset=position_offset, attention_scaling=attention_scaling,
                                             v_gathered=v_gathered, scale=scale, mask=mask, num_splits=num_splits)
    else:
        tok = _ref.chunks_to_tokens(idx, chunk_size, N)
        out, lse = _ref.lowrank_decode_ref(q4, U, SV, v, tok, inv_freq, scale=scale, positions=positions,
                                           position_offset=position_offset, attention_scaling=attention_scaling,
                                           v_gathered=v_gathered, mask=mask, rope_table=rope_table)
    if extra_k is not None or extra_v is not None:
        if extra_k is None or extra_v is None:
            fail(fn, "extra_k and extra_v go together")
        o2, l2 = weighted_decode(q4, extra_k, extra_v, None, scale=scale, valid=extra_valid, return_lse=True)
        out, lse = merge_attn(out, lse, o2, l2)
    return finish(out, lse, q.dim() == 3, return_lse)


def _lowrank_traced(q, q4, U, SV, v, chunk_ids, chunk_size, inv_freq, positions, position_offset, attention_scaling,
                    v_gathered, extra_k, extra_v, extra_valid, scale, valid, return_lse, rope_table):
    """:func:`lowrank_decode` while ``torch.compile`` traces: ``torch.ops.kvkit.lowrank_decode`` (the eager function
    behind an operator, so the graph launches the Triton kernel on CUDA and needs no host value); the rope table is
    made here only when there is no ``inv_freq`` (the reference then reads it)."""
    if valid is not None:
        fail("lowrank_decode", "valid is not supported in a compiled step (mark the chunks -1 in chunk_ids)")
    table = None
    if inv_freq is None:
        table = rope_table() if callable(rope_table) else rope_table
        if table is None:
            fail("lowrank_decode", "needs inv_freq or rope_table")
    scale = default_scale(scale, q4.shape[-1])
    out, lse = torch.ops.kvkit.lowrank_decode(q4, U, SV, v, chunk_ids, int(chunk_size), inv_freq,
                                              positions, position_offset, float(attention_scaling), bool(v_gathered),
                                              None if table is None else table[0],
                                              None if table is None else table[1], float(scale))
    if extra_k is not None or extra_v is not None:
        o2, l2 = weighted_decode(q4, extra_k, extra_v, None, scale=scale, valid=extra_valid, return_lse=True)
        out, lse = merge_attn(out, lse, o2, l2)
    return finish(out, lse, q.dim() == 3, return_lse)


def _lowrank_rope(fn, q, inv_freq, rope_table, fused: bool):
    """The rope table :func:`lowrank_decode`'s torch path reads: ``rope_table`` (a callable is called only when the
    Triton path does not run, ``fused`` False; None then), checked to be a ``(cos, sin)`` pair of equal ``[P, Dr]``
    tensors on q's device, or None. Without a table ``inv_freq`` is required; given, it is checked to be a 1-D tensor
    on q's device."""
    if callable(rope_table):  # built only where the torch path runs (the Triton path does not read it)
        rope_table = None if fused else rope_table()
    if rope_table is not None:
        if not (isinstance(rope_table, (tuple, list)) and len(rope_table) == 2):
            fail(fn, "rope_table must be a (cos, sin) pair of [P, Dr] tensors")
        for name, t in zip(("rope_table cos", "rope_table sin"), rope_table):
            check_tensor(fn, name, t, 2, None, q.device)
        if rope_table[0].shape != rope_table[1].shape:
            fail(fn, f"rope_table cos {tuple(rope_table[0].shape)} and sin {tuple(rope_table[1].shape)} differ")
    elif inv_freq is None:
        fail(fn, "give inv_freq (or a rope_table)")
    if inv_freq is not None:
        check_tensor(fn, "inv_freq", inv_freq, 1, None, q.device)
    return rope_table


def _lowrank_factors(fn, q, U, SV, v, inv_freq, rope_table) -> tuple[int, int]:
    """Check the low-rank factors against q ``[B, Hq, (Tq,) D]``: U ``[B, N, r]`` and SV ``[B, Hkv, r, D]`` of one
    float dtype, Hq a multiple of Hkv, v of q's dtype, and the rotary dims (2 x inv_freq entries, else the rope
    table's width) even and in (0, D], inv_freq and the table agreeing where both are given. Returns ``(N, Hkv)``."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    if U.dtype != SV.dtype or not U.is_floating_point():
        fail(fn, f"U and SV must share one float dtype, got {U.dtype} and {SV.dtype}")
    if v.dtype != q.dtype:
        fail(fn, f"v must have q's dtype {q.dtype}, got {v.dtype}")
    N, r = U.shape[1], U.shape[2]
    Hkv = SV.shape[1]
    if U.shape[0] != B or SV.shape[0] != B or SV.shape[2] != r or SV.shape[3] != D or Hkv == 0 or Hq % Hkv:
        fail(fn, f"shapes do not fit: q {tuple(q.shape)}, U {tuple(U.shape)} [B, N, r], SV {tuple(SV.shape)} "
                 f"[B, Hkv, r, D] (Hq a multiple of Hkv)")
    dr = 2 * inv_freq.shape[0] if inv_freq is not None else rope_table[0].shape[1]
    if dr > D or dr == 0 or dr % 2:
        fail(fn, f"rotary dims {dr} (2 x inv_freq entries, or the rope_table width) must be even and in (0, D={D}]")
    if inv_freq is not None and rope_table is not None and rope_table[0].shape[1] != dr:
        fail(fn, f"rope_table has {rope_table[0].shape[1]} rotary dims but inv_freq gives {dr}")
    return N, Hkv


def _lowrank_values(fn, v, idx, chunk_size, v_gathered: bool, B: int, Hkv: int, N: int, D: int) -> None:
    """Check ``chunk_size`` (a positive int) and the values v: ``[B, Hkv, N, D]`` indexed by token row, or with
    ``v_gathered`` ``[B, Hkv, Ti*C*chunk_size, D]`` for the chunk ids ``idx`` ``[B, Hkv, Ti, C]``."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        fail(fn, f"chunk_size must be a positive int, got {chunk_size!r}")
    L = idx.shape[3] * chunk_size
    if v_gathered:
        if tuple(v.shape) != (B, Hkv, idx.shape[2] * L, D):
            fail(fn, f"v_gathered: v must be [B, Hkv, Ti*C*chunk_size={idx.shape[2] * L}, D], got {tuple(v.shape)}")
    elif tuple(v.shape) != (B, Hkv, N, D):
        fail(fn, f"v must be [B={B}, Hkv={Hkv}, N={N}, D={D}] (the value store), got {tuple(v.shape)}")


def _lowrank_positions(fn, positions, position_offset, B: int, N: int, device) -> None:
    """Check the keys' positions where given: positions ``[B, N]`` and position_offset ``[B]``, int32/int64 on
    ``device``."""
    if positions is not None:
        check_tensor(fn, "positions", positions, 2, (torch.int32, torch.int64), device)
        if tuple(positions.shape) != (B, N):
            fail(fn, f"positions must be [B={B}, N={N}], got {tuple(positions.shape)}")
    if position_offset is not None:
        check_tensor(fn, "position_offset", position_offset, 1, (torch.int32, torch.int64), device)
        if position_offset.shape[0] != B:
            fail(fn, f"position_offset must be [B={B}], got {tuple(position_offset.shape)}")


def lowrank_token_decode(q, U, SV, v, tok, rope_half, *, scale=None, position_offset=None, positions=None,
                         exact=()):
    """ShadowKV's single-token CPU step: keys rebuilt from low-rank factors at token ids, plus exact parts, in one
    softmax, through the C kernel of :mod:`.decode_cpu` (keys rebuilt in registers, never stored).

    q ``[B, Hq, 1, D]``; U ``[B, N, r]``; SV ``[B, Hkv, r, D]``; v ``[B, Hkv, N, D]``; tok ``[B, Hkv, K]`` token ids
    (-1 = none); rope_half ``(cos_half, sin_half)`` ``[P, Dr/2]`` (rotate_half tables' first halves, attention
    scaling included) or None; position_offset ``[B]`` or positions ``[B, N]``; exact: up to 4 ``(keys, values,
    pos)`` parts (keys/values ``[B, Hkv, n, D]``, pos ``[B, Hkv|1, n]`` int32, < 0 not read) attended jointly.
    Returns ``(out [B, Hq, 1, D] fp32, lse [B, Hq, 1] fp32)``; exact parts whose layout the C kernel cannot read
    (rows not contiguous, unequal K/V strides) are attended by :func:`weighted_decode` and merged by LSE. Returns
    None where the C kernel does not serve these inputs (not CPU fp32 contiguous, no C compiler, no rope_half):
    the caller's torch path runs then.
    """
    if rope_half is None or not decode_cpu.supported(q, U, SV, v) or not decode_cpu.available():
        return None
    scale = default_scale(scale, q.shape[-1])
    D = SV.shape[-1]
    fits = [(k, vv, p) for k, vv, p in exact
            if k.stride() == vv.stride() and k.stride(-2) == D and k.stride(-1) == 1]
    if len(fits) == len(exact):
        return decode_cpu.lowrank_attn(q, U, SV, v, tok, scale, *rope_half, exact=exact,
                                       position_offset=position_offset, positions=positions)
    out, lse = decode_cpu.lowrank_attn(q, U, SV, v, tok, scale, *rope_half, exact=fits,
                                       position_offset=position_offset, positions=positions)
    for k, vv, p in exact:
        if any(k is f[0] for f in fits) or k.shape[-2] == 0:
            continue
        B, H, n = k.shape[0], k.shape[1], k.shape[2]
        lw = torch.zeros((), device=q.device).expand(B, H, n).masked_fill(p.expand(B, H, n) < 0, float("-inf"))
        o, s = weighted_decode(q.to(k.dtype), k, vv, lw, scale=scale, return_lse=True)
        out, lse = merge_attn(out, lse, o.float(), s)
    return out, lse
