"""Decode-attention kernels for compressed KV caches, with plain-torch references.

Public API (shapes: B batch, Hq query heads, Hkv KV heads, Tq query tokens, N stored tokens, D head dim)

* :func:`decode` -- one query token over a :class:`DecodeView` (the decode seam: fixed capacity, no host sync).
* :func:`sparse_decode` -- attention over listed token indices (per KV head or per query head).
* :func:`merge_attn` -- combine two partial results through their log-sum-exp; :func:`merge_partials`, any number.
* :func:`weighted_decode` -- dense attention with an additive per-key log-weight.
* :func:`quantize` / :func:`dequantize` / :func:`packed_nbytes` / :func:`quant_decode` -- int8/4/2 KV.
* :func:`lowrank_decode` -- ShadowKV: keys rebuilt from low-rank factors + RoPE, attended with their values.
* :func:`lowrank_token_decode` -- ShadowKV's single-token CPU step through the C kernel (None where it cannot run).
* :func:`chunk_scores` / :func:`topk_indices` -- chunk selection helpers.

Callers: ``tidal`` (sparse_decode), ``chelsea`` (decode, through ``attend_slots``), ``zipcache`` (quantize,
decode with packed parts, quant_decode), ``shadowkv`` (chunk_scores, topk_indices, lowrank_decode, lowrank_token_decode, merge_attn).

Dispatch: CUDA tensors with Triton importable -> Triton kernels; anything else -> the torch reference
(fp32 math). ``KVKIT_KERNELS=reference`` forces the reference, ``KVKIT_KERNELS=triton`` forces Triton
(on CPU tensors that needs ``TRITON_INTERPRET=1``, which the tests set). Triton is imported only when a
Triton kernel is about to run. ``KVKIT_DEBUG=1`` checks index ranges on the host and raises a clear
IndexError (one device sync); without it, out-of-range entries are treated as padding and never read.
"""

from __future__ import annotations

import contextlib

import torch

from kvkit import env

from . import reference as _ref
from ._common import (
    check_indices,
    check_qkv,
    check_range,
    check_tensor,
    check_valid,
    debug,
    default_scale,
    fail,
)
from ._triton import require_triton, triton_available
from .decode_op import compiled_decode
from .gather import gather_attend, gather_attend_torch
from .quant import Packed, dequantize, packed_nbytes, quantize
from .reference import merge_attn, merge_partials
from .scoring import chunk_scores, topk_indices
from .view import DecodeView, PackedPart, check_view, check_view_ranges

__all__ = [
    "DecodeView", "PackedPart", "decode",
    "Packed", "backend", "chunk_scores", "dequantize", "gather_attend", "gather_attend_torch", "lowrank_decode",
    "merge_attn",
    "merge_partials",
    "lowrank_token_decode", "packed_nbytes", "quant_decode", "quantize", "sparse_decode",
    "topk_indices", "use_triton", "weighted_decode",
]


def use_triton(*tensors: torch.Tensor) -> bool:
    """Which path runs for these tensors: ``KVKIT_KERNELS`` = auto (default) | reference | triton."""
    mode = env.kernels_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        require_triton()
        return True
    return all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor)) and triton_available()


def _on_device(t: torch.Tensor):
    """Launch on ``t``'s GPU: Triton launches on the *current* CUDA device, which need not be the one the
    layer lives on when device_map spreads a model over several GPUs."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def backend(device=None) -> str:
    """Human-readable kernel path for a device (used by ``kvkit doctor``)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if env.kernels_mode() == "reference":
        return "torch reference (KVKIT_KERNELS=reference)"
    if dev.type == "cuda" and triton_available():
        import triton

        return f"triton {triton.__version__}"
    return "torch reference" + ("" if triton_available() else " (triton not installed)")


def _finish(out, lse, squeeze, return_lse):
    if squeeze:
        out, lse = out.squeeze(2), lse.squeeze(2)
    return (out, lse) if return_lse else out


def sparse_decode(q, k, v, indices, *, scale=None, index_mode="kv_head", valid=None, return_lse=False,
                  num_splits=None):
    """Decode attention over selected tokens.

    Parameters
    ----------
    q : ``[B, Hq, D]`` (one query token) or ``[B, Hq, Tq, D]`` (a few, e.g. speculative verification;
        all Tq tokens see the same selected keys, no causal mask among them).
    k, v : ``[B, Hkv, N, D]``, same dtype as q (fp16/bf16/fp32), Hq a multiple of Hkv (GQA).
    indices : int32/int64 token ids ``[B, Hkv, K]`` (index_mode="kv_head": one list per KV head, shared
        by its query group; each K/V row is read once per group) or ``[B, Hq, K]`` ("q_head"); a 4-D
        ``[B, Hidx, Tq, K]`` gives each query token its own list. -1 = no token (ragged padding).
    scale : softmax scale, default ``1/sqrt(D)``.
    valid : None, int lengths ``[B]`` (keys ``>= valid[b]`` ignored) or bool key mask ``[B, N]``.
    return_lse : also return the log-sum-exp ``[B, Hq]`` / ``[B, Hq, Tq]`` (fp32) for :func:`merge_attn`.
    num_splits : split-K factor of the Triton kernel (default: sized to the GPU).

    Returns out with q's shape and dtype (zeros where no key is visible; lse = -inf there).
    """
    fn = "sparse_decode"
    q4, squeeze, B, Hq, Tq, Hkv, N, D = check_qkv(fn, q, k, v)
    idx = check_indices(fn, indices, B, Hq, Hkv, Tq, index_mode, q.device)
    mask = check_valid(fn, valid, B, N, q.device)
    scale = default_scale(scale, D)
    if debug():
        check_range(fn, "indices", idx, N)
    if use_triton(q, k, v, idx):
        from .sparse import gather_attn

        with _on_device(q):
            out, lse = gather_attn(q4, k, v, idx, mode=1, scale=scale, mask=mask, num_splits=num_splits)
    else:
        out, lse = _ref.sparse_decode_ref(q4, k, v, idx, scale=scale, mask=mask)
    return _finish(out, lse, squeeze, return_lse)


def weighted_decode(q, k, v, log_weight=None, *, scale=None, valid=None, return_lse=False, num_splits=None):
    """Dense decode attention with an additive per-key bias.

    q ``[B, Hq, D]`` or ``[B, Hq, Tq, D]``; k, v ``[B, Hkv, N, D]``; log_weight ``[B, Hkv, N]`` float
    (natural-log units, e.g. ``log(cluster_size)``; ``-inf`` hides a key) or None; valid as in
    :func:`sparse_decode`. Returns out (q's shape) [+ lse].
    """
    fn = "weighted_decode"
    q4, squeeze, B, Hq, Tq, Hkv, N, D = check_qkv(fn, q, k, v)
    if log_weight is not None:
        check_tensor(fn, "log_weight", log_weight, 3, (torch.float16, torch.bfloat16, torch.float32,
                                                      torch.float64), q.device)
        if tuple(log_weight.shape) != (B, Hkv, N):
            fail(fn, f"log_weight must be [B={B}, Hkv={Hkv}, N={N}], got {tuple(log_weight.shape)}")
    mask = check_valid(fn, valid, B, N, q.device)
    scale = default_scale(scale, D)
    if use_triton(q, k, v):
        from .weighted import weighted_decode_triton

        with _on_device(q):
            out, lse = weighted_decode_triton(q4, k, v, log_weight, scale=scale, mask=mask, num_splits=num_splits)
    else:
        out, lse = _ref.dense_decode_ref(q4, k, v, scale=scale, mask=mask, bias=log_weight)
    return _finish(out, lse, squeeze, return_lse)


def quant_decode(q, kpack, vpack, *, scale=None, valid=None, return_lse=False, num_splits=None, prior=None):
    """Decode attention straight from packed int8/int4/int2 keys and values (no fp16 K/V materialised).

    q ``[B, Hq, D]`` or ``[B, Hq, Tq, D]``; kpack, vpack: :class:`Packed` of tensors ``[B, Hkv, N, D]``
    from :func:`quantize` (any bits/group/axis, optional ``channel_prescale``); valid as in
    :func:`sparse_decode`. kpack, vpack (and valid) may also be equal-length lists of parts (e.g. precision
    groups, segments; N may differ between parts): the result is attention over their union. ``prior``:
    ``(out, lse)`` of the same queries over other keys (q's shape + ``[..., D]`` / lse), merged into the result
    (as :func:`merge_attn`). Returns out in q's shape and dtype [+ lse]. Paths: CUDA -> Triton (per part, merged
    by LSE; needs D/(8/bits) a power of two >= 16: int8 D >= 16, int4 D >= 32, int2 D >= 64); CPU -> the C
    kernel of :mod:`.quant_cpu` (all parts and the prior in one call, codes unpacked in registers) where it
    builds and the layout fits; otherwise the reference.
    """
    fn = "quant_decode"
    check_tensor(fn, "q", q, (3, 4), (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    many = isinstance(kpack, (list, tuple))
    kps, vps = (list(kpack), list(vpack)) if many else ([kpack], [vpack])
    valids = (list(valid) if valid is not None else [None] * len(kps)) if many else [valid]
    if not kps or len(vps) != len(kps) or len(valids) != len(kps):
        fail(fn, f"kpack, vpack (and valid) must be Packed or equal-length non-empty lists, got {len(kps)} / "
                 f"{len(vps) if isinstance(vps, list) else type(vpack).__name__} / {len(valids)}")
    q4 = q.unsqueeze(2) if q.dim() == 3 else q
    B, Hq, Tq, D = q4.shape
    for kp, vp in zip(kps, vps):
        for name, p in (("kpack", kp), ("vpack", vp)):
            if not isinstance(p, Packed):
                fail(fn, f"{name} must be a kvkit.kernels.Packed (from quantize), got {type(p).__name__}")
            if len(p.shape) != 4:
                fail(fn, f"{name} must pack a [B, Hkv, N, D] tensor, got shape {tuple(p.shape)}")
            if p.data.device != q.device:
                fail(fn, f"{name} is on {p.data.device} but q is on {q.device}")
        if tuple(kp.shape) != tuple(vp.shape):
            fail(fn, f"kpack {tuple(kp.shape)} and vpack {tuple(vp.shape)} must pack the same [B, Hkv, N, D]")
        _, Hkv, N, Dk = kp.shape
        if kp.shape[0] != B or Dk != D or Hq % Hkv or Hkv != kps[0].shape[1]:
            fail(fn, f"packed K/V {tuple(kp.shape)} do not match q {tuple(q.shape)} (B, D, Hq % Hkv == 0)")
    if prior is not None:
        po, pl = prior
        po = po.unsqueeze(2) if po.dim() == 3 else po
        pl = pl.unsqueeze(2) if pl.dim() == 2 else pl
        if tuple(po.shape) != (B, Hq, Tq, D) or tuple(pl.shape) != (B, Hq, Tq):
            fail(fn, f"prior must be (out [B, Hq, (Tq,) D], lse [B, Hq, (Tq)]) like q {tuple(q.shape)}, got "
                     f"{tuple(prior[0].shape)} / {tuple(prior[1].shape)}")
        prior = (po, pl)
    scale = default_scale(scale, D)

    def masks():  # (no host read of the lengths: a decode step does not synchronise)
        return [check_valid(fn, val, B, kp.shape[-2], q.device) for kp, val in zip(kps, valids)]

    out = lse = None
    if use_triton(q, kps[0].data, vps[0].data) and all(_quant_supported(D, k.bits, v.bits) for k, v in zip(kps, vps)):
        from .quant_attn import quant_decode_triton

        with _on_device(q):
            for kp, vp, mask in zip(kps, vps, masks()):
                o, s = quant_decode_triton(q4, kp, vp, scale=scale, mask=mask, num_splits=num_splits)
                out, lse = (o, s) if out is None else merge_attn(out, lse, o, s)
    else:
        from . import quant_cpu

        if (q.device.type == "cpu" and env.kernels_mode() != "reference"
                and q.dtype != torch.float64 and all(quant_cpu.supported(k, v, D) for k, v in zip(kps, vps))
                and quant_cpu.available()):
            out, lse = quant_cpu.quant_attn(q4, list(zip(kps, vps, masks())), scale, prior=prior)
            return _finish(out, lse, q.dim() == 3, return_lse)
        for kp, vp, mask in zip(kps, vps, masks()):
            o, s = _ref.quant_decode_ref(q4, kp, vp, scale=scale, mask=mask)
            out, lse = (o, s) if out is None else merge_attn(out, lse, o, s)
    if prior is not None:
        out, lse = merge_attn(out, lse, prior[0].to(out.dtype), prior[1])
    return _finish(out, lse, q.dim() == 3, return_lse)


def _quant_supported(D, kbits, vbits):
    def ok(bits):
        db = D // (8 // bits)
        return db >= 16 and db & (db - 1) == 0
    return ok(kbits) and ok(vbits)


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

        with _on_device(q):
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
    return _finish(out, lse, q.dim() == 3, return_lse)


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
    return _finish(out, lse, q.dim() == 3, return_lse)


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
    from . import decode_cpu

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


def decode(q, view, *, scale=None, return_lse=False, num_splits=None):
    """Decode attention of one query token per row over a :class:`DecodeView` (the decode seam).

    q ``[B, Hq, D]`` (or ``[B, Hq, 1, D]``); view: keys/values ``[B, H, cap, D]`` of q's dtype with Hq a
    multiple of H, read through its ``length`` / ``index`` / ``pos``+``qpos`` / ``log_weight`` and merged with
    its ``parts`` by log-sum-exp (see :mod:`kvkit.kernels.view` for the slot rule). Returns out in q's shape
    and dtype (zeros where no key is visible) [+ lse ``[B, Hq]`` fp32, -inf there].

    No host synchronisation and fixed shapes: checks look at shapes, dtypes and devices only (``KVKIT_DEBUG=1``
    adds a range check that syncs), and the split-K factor depends on shapes only, so a step can be captured
    by CUDA graphs or ``torch.compile(fullgraph=True)``. Paths: Triton (``fused_decode``; packed parts through
    ``quant_attn``) or the torch reference (``reference.decode_ref``, fp32 math), chosen by :func:`use_triton`.
    Traced by ``torch.compile``, a view without parts is one opaque operator (``torch.ops.kvkit.view_decode``,
    :mod:`.decode_op`) that picks the same path when the graph runs.
    ``num_splits``: split-K factor of the Triton kernels (default: sized to the device).
    """
    fn = "decode"
    q3, squeeze = check_view(fn, q, view)
    scale = default_scale(scale, q3.shape[-1])
    if debug():
        check_view_ranges(fn, view)
    if torch.compiler.is_compiling():
        out, lse = compiled_decode(q3, view, scale, num_splits)
    elif use_triton(q, *view.tensors()):
        from .fused_decode import decode_triton

        with _on_device(q):
            out, lse = decode_triton(q3, view, scale=scale, num_splits=num_splits)
    else:
        out, lse = _ref.decode_ref(q3, view, scale=scale)
    out = out.to(q.dtype) if squeeze else out.to(q.dtype)[:, :, None]
    return (out, lse) if return_lse else out
