# ruff: noqa: UP045  (Optional[...] annotations: torch.library.custom_op infers the schema from them)
"""``torch.ops.kvkit.view_decode``: the decode seam as one opaque operator inside compiled graphs.

:func:`kvkit.kernels.decode` calls this operator when ``torch.compile`` traces it (a static store's compiled decode
step), so the compiled graph launches the fused split-K Triton kernel (``fused_decode``) instead of inductor's
SDPA over the whole buffer. Why: inductor's attention over a static buffer is SDPA with a boolean mask, i.e.
the memory-efficient kernel: one program per (row, KV head) walking every key, no split over the keys, so a
decode step runs few, long programs; the split-K kernel spreads the keys over many programs and reads the KV
at the memory bandwidth (the two compared on an H100: results/bench/gpu/h100-b16-16k-2026-11-26/README.md).

The operator takes a :class:`~kvkit.kernels.view.DecodeView` without parts as its tensors:

    view_decode(q [B, Hq, D], k [B, H, cap, D], v, length?, index?, pos?, qpos?, log_weight?, scale, num_splits?)
        -> (out [B, Hq, D] in q's dtype, lse [B, Hq] fp32)

(the slot rule and shapes of :mod:`kvkit.kernels.view`). Its implementation picks the path at run time like
:func:`kvkit.kernels.decode` (Triton where :func:`kvkit.kernels.use_triton` says so, else the torch reference); its
fake implementation gives the output shapes, so Dynamo traces a step around it with ``fullgraph=True`` and CUDA
graphs capture its launches (no host synchronisation, splits from shapes only). Outputs never alias inputs.

This module has no ``from __future__ import annotations``: ``torch.library.custom_op`` reads the annotations.
"""

from typing import Optional  # noqa: UP035 -- custom_op reads these annotations; Optional works on every torch

import torch

from . import reference as _ref
from .view import DecodeView


def _view(k, v, length, index, pos, qpos, log_weight) -> DecodeView:
    return DecodeView(k, v, length=length, index=index, pos=pos, qpos=qpos, log_weight=log_weight)


@torch.library.custom_op("kvkit::view_decode", mutates_args=())
def view_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: Optional[torch.Tensor],
                index: Optional[torch.Tensor], pos: Optional[torch.Tensor], qpos: Optional[torch.Tensor],
                log_weight: Optional[torch.Tensor], scale: float,
                num_splits: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from . import _on_device, use_triton

    view = _view(k, v, length, index, pos, qpos, log_weight)
    if use_triton(q, *view.tensors()):
        from .fused_decode import fused_decode_triton

        with _on_device(q):
            out, lse = fused_decode_triton(q, view, scale=scale, num_splits=num_splits)
    else:
        out, lse = _ref.decode_ref(q, view, scale=scale)
    return out.to(q.dtype), lse.float()


@view_decode.register_fake
def _view_decode_fake(q, k, v, length, index, pos, qpos, log_weight, scale, num_splits):
    B, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq), dtype=torch.float32)


def compiled_decode(q3: torch.Tensor, view: DecodeView, scale: float, num_splits: Optional[int]):
    """What :func:`kvkit.kernels.decode` runs while ``torch.compile`` traces: the operator for a view without parts,
    the traced torch reference otherwise (packed / nested parts are not an operator argument).
    Returns ``(out [B, Hq, D], lse [B, Hq] fp32)``."""
    if view.parts or view.k is None:
        return _ref.decode_ref(q3, view, scale=scale)
    return torch.ops.kvkit.view_decode(q3, view.k, view.v, view.length, view.index, view.pos, view.qpos,
                                       view.log_weight, float(scale), num_splits)
