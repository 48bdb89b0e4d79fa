# ruff: noqa: UP045  (Optional[...] annotations: torch.library.custom_op infers the schema from them)
"""``torch.ops.kvkit.view_decode``: the decode seam as one opaque operator inside compiled graphs.

:func:`kvkit.kernels.decode` calls this operator when ``torch.compile`` traces it (a static store's compiled decode
step), so the compiled graph launches the fused split-K Triton kernel (``fused_decode``) instead of inductor's
SDPA over the whole buffer. Why: inductor's attention over a static buffer is SDPA with a boolean mask, i.e.
the memory-efficient kernel: one program per (row, KV head) walking every key, no split over the keys, so a
decode step runs few, long programs; the split-K kernel spreads the keys over many programs and reads the KV
at the memory bandwidth (the two compared on an H100: results/speed-gpu/README.md, results/speed-gpu/h100-llama-3.2-1b-b16-16k-2026-11-26).

The operator takes a :class:`~kvkit.kernels.view.DecodeView` without parts as its tensors:

    view_decode(q [B, Hq, D], k [B, H, cap, D], v, length?, index?, pos?, qpos?, log_weight?, scale, num_splits?)
        -> (out [B, Hq, D] in q's dtype, lse [B, Hq] fp32)

(the slot rule and shapes of :mod:`kvkit.kernels.view`). A :class:`~kvkit.kernels.view.PackedPart` is a second operator,
``packed_decode`` (its :class:`~kvkit.kernels.Packed` keys and values as tensors plus their bit widths, group sizes and
axes), read by :func:`kvkit.kernels.quant_decode` (Triton, the C kernel or the torch reference); :func:`compiled_decode` reads a view with parts
as one operator per part, merged by log-sum-exp in the graph. Each implementation picks the path at run time like
:func:`kvkit.kernels.decode` (Triton where :func:`kvkit.kernels.use_triton` says so, else the torch reference); its
fake implementation gives the output shapes, so Dynamo traces a step around it with ``fullgraph=True`` and CUDA
graphs capture its launches (no host synchronisation, splits from shapes only). Outputs never alias inputs.
ShadowKV's low-rank chunks are a third operator, ``lowrank_decode`` (:func:`lowrank_op`), which
:func:`kvkit.kernels.lowrank_decode` calls when traced.

This module has no ``from __future__ import annotations``: ``torch.library.custom_op`` reads the annotations.
"""

from typing import Optional  # noqa: UP035 -- custom_op reads these annotations; Optional works on every torch

import torch

from . import reference as _ref
from .dispatch import on_device, use_triton
from .lowrank_read import lowrank_decode
from .packed import quant_decode
from .quant import Packed
from .view import DecodeView, PackedPart


def _view(k, v, length, index, pos, qpos, log_weight) -> DecodeView:
    return DecodeView(k, v, length=length, index=index, pos=pos, qpos=qpos, log_weight=log_weight)


@torch.library.custom_op("kvkit::view_decode", mutates_args=())
def view_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: Optional[torch.Tensor],
                index: Optional[torch.Tensor], pos: Optional[torch.Tensor], qpos: Optional[torch.Tensor],
                log_weight: Optional[torch.Tensor], scale: float,
                num_splits: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    view = _view(k, v, length, index, pos, qpos, log_weight)
    if use_triton(q, *view.tensors()):
        from .fused_decode import fused_decode_triton

        with on_device(q):
            out, lse = fused_decode_triton(q, view, scale=scale, num_splits=num_splits)
    else:
        out, lse = _ref.decode_ref(q, view, scale=scale)
    return out.to(q.dtype), lse.float()


@view_decode.register_fake
def _view_decode_fake(q, k, v, length, index, pos, qpos, log_weight, scale, num_splits):
    B, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq), dtype=torch.float32)


def _packed(data, scale, zero, prescale, bits, group_size, axis, dtype) -> Packed:
    B, H, N = data.shape[:3]
    D = data.shape[3] * 8 // bits
    return Packed(data, scale, zero, bits, group_size, axis, (B, H, N, D), dtype, prescale)


@torch.library.custom_op("kvkit::packed_decode", mutates_args=())
def packed_decode(q: torch.Tensor, kdata: torch.Tensor, kscale: torch.Tensor, kzero: torch.Tensor,
                  kprescale: Optional[torch.Tensor], vdata: torch.Tensor, vscale: torch.Tensor, vzero: torch.Tensor,
                  vprescale: Optional[torch.Tensor], length: Optional[torch.Tensor], kbits: int, kgroup: int,
                  kaxis: int, vbits: int, vgroup: int, vaxis: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token ``q [B, Hq, D]`` over a packed part (codes ``[B, H, N, D*bits/8]`` with their statistics,
    ``length [B]`` or None) -> ``(out [B, Hq, D] in q's dtype, lse [B, Hq] fp32)``, read by
    :func:`kvkit.kernels.quant_decode` (quant_attn's Triton kernel on CUDA, the packed-code C kernel on the CPU, the
    reference elsewhere)."""
    k = _packed(kdata, kscale, kzero, kprescale, kbits, kgroup, kaxis, q.dtype)
    v = _packed(vdata, vscale, vzero, vprescale, vbits, vgroup, vaxis, q.dtype)
    out, lse = quant_decode(q, k, v, scale=scale, valid=length, return_lse=True)
    return out.to(q.dtype), lse.float()


@packed_decode.register_fake
def _packed_decode_fake(q, kdata, kscale, kzero, kprescale, vdata, vscale, vzero, vprescale, length, kbits, kgroup,
                        kaxis, vbits, vgroup, vaxis, scale):
    B, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq), dtype=torch.float32)


@torch.library.custom_op("kvkit::lowrank_decode", mutates_args=())
def lowrank_op(q: torch.Tensor, U: torch.Tensor, SV: torch.Tensor, v: torch.Tensor, chunk_ids: torch.Tensor,
               chunk_size: int, inv_freq: Optional[torch.Tensor], positions: Optional[torch.Tensor],
               position_offset: Optional[torch.Tensor], attention_scaling: float, v_gathered: bool,
               rope_cos: Optional[torch.Tensor], rope_sin: Optional[torch.Tensor],
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ShadowKV's read of the selected chunks as one operator: ``q [B, Hq, T, D]`` and the arguments of
    :func:`kvkit.kernels.lowrank_decode` (``rope_cos``/``rope_sin`` its ``rope_table``, both or neither) ->
    ``(out [B, Hq, T, D] in q's dtype, lse [B, Hq, T] fp32)``; the Triton kernel on CUDA, the torch reference
    elsewhere, chosen when the graph runs."""
    table = None if rope_cos is None else (rope_cos, rope_sin)
    out, lse = lowrank_decode(q, U, SV, v, chunk_ids, chunk_size, inv_freq, positions=positions,
                              position_offset=position_offset, attention_scaling=attention_scaling,
                              v_gathered=v_gathered, scale=scale, return_lse=True, rope_table=table)
    return out.to(q.dtype), lse.float()


@lowrank_op.register_fake
def _lowrank_op_fake(q, U, SV, v, chunk_ids, chunk_size, inv_freq, positions, position_offset, attention_scaling,
                     v_gathered, rope_cos, rope_sin, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _packed_op(q3: torch.Tensor, part: PackedPart, scale: float):
    k, v = part.k, part.v
    return torch.ops.kvkit.packed_decode(q3, k.data, k.scale, k.zero, k.prescale, v.data, v.scale, v.zero,
                                         v.prescale, part.length, k.bits, k.group_size, k.axis, v.bits,
                                         v.group_size, v.axis, float(scale))


def compiled_decode(q3: torch.Tensor, view: DecodeView, scale: float, num_splits: Optional[int]):
    """What :func:`kvkit.kernels.decode` runs while ``torch.compile`` traces: the view's own keys through
    ``view_decode``, every packed part through ``packed_decode`` and every nested view the same way, merged by
    log-sum-exp (traced torch). Returns ``(out [B, Hq, D], lse [B, Hq] fp32)``."""
    res = []
    if view.k is not None:
        res.append(torch.ops.kvkit.view_decode(q3, view.k, view.v, view.length, view.index, view.pos, view.qpos,
                                               view.log_weight, float(scale), num_splits))
    for part in view.parts:
        if isinstance(part, PackedPart):
            res.append(_packed_op(q3, part, scale))
        else:
            res.append(compiled_decode(q3, part, scale, num_splits))
    if not res:
        raise ValueError("kvkit.kernels.decode: a view with neither keys nor parts reads nothing")
    out, lse = res[0]
    for o, s in res[1:]:
        out, lse = _ref.merge_attn(out, lse, o, s)
    return out, lse
