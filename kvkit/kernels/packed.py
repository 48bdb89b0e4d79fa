"""Decode attention straight from packed int8/int4/int2 keys and values (:func:`quant_decode`): Triton on CUDA,
the packed-code C kernel on the CPU, the torch reference elsewhere."""

from __future__ import annotations

import torch

from kvkit import env

from . import quant_cpu
from . import reference as _ref
from ._common import check_tensor, check_valid, default_scale, fail
from .dispatch import on_device, use_triton
from .quant import Packed
from .reference import merge_attn
from .selected import finish


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

        with on_device(q):
            for kp, vp, mask in zip(kps, vps, masks()):
                o, s = quant_decode_triton(q4, kp, vp, scale=scale, mask=mask, num_splits=num_splits)
                out, lse = (o, s) if out is None else merge_attn(out, lse, o, s)
    else:
        if (q.device.type == "cpu" and env.kernels_mode() != "reference"
                and q.dtype != torch.float64 and all(quant_cpu.supported(k, v, D) for k, v in zip(kps, vps))
                and quant_cpu.available()):
            out, lse = quant_cpu.quant_attn(q4, list(zip(kps, vps, masks())), scale, prior=prior)
            return finish(out, lse, q.dim() == 3, return_lse)
        for kp, vp, mask in zip(kps, vps, masks()):
            o, s = _ref.quant_decode_ref(q4, kp, vp, scale=scale, mask=mask)
            out, lse = (o, s) if out is None else merge_attn(out, lse, o, s)
    if prior is not None:
        out, lse = merge_attn(out, lse, prior[0].to(out.dtype), prior[1])
    return finish(out, lse, q.dim() == 3, return_lse)


def _quant_supported(D, kbits, vbits):
    def ok(bits):
        db = D // (8 // bits)
        return db >= 16 and db & (db - 1) == 0
    return ok(kbits) and ok(vbits)
