"""The decode seam: :func:`decode`, one query token per row over a :class:`~kvkit.kernels.view.DecodeView`, and the
one place a store's single-token read learns which backend serves it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import reference as _ref
from ._common import debug, default_scale
from .decode_op import compiled_decode
from .dispatch import launch_failed, on_device, record_launch_failure, use_triton
from .view import DecodeView, check_view, check_view_ranges

#: ``torch_path`` values of :func:`decode`
TORCH_PATHS = ("reference", "caller")


def decode(q, view: DecodeView | Callable[[], DecodeView], *, scale=None, return_lse=False, num_splits=None,
           torch_path: str = "reference"):
    """Decode attention of one query token per row over a :class:`DecodeView` (the decode seam).

    q ``[B, Hq, D]`` (or ``[B, Hq, 1, D]``); view: keys/values ``[B, H, cap, D]`` of q's dtype with Hq a
    multiple of H, read through its ``length`` / ``index`` / ``pos``+``qpos`` / ``log_weight`` and merged with
    its ``parts`` by log-sum-exp (see :mod:`kvkit.kernels.view` for the slot rule), or a zero-argument function
    that builds it (called only where a kernel reads the view). Returns out in q's shape and dtype (zeros where no
    key is visible) [+ lse ``[B, Hq]`` fp32, -inf there].

    The backend is picked here and nowhere else: the fused split-K Triton kernel (``fused_decode``; packed parts
    through ``quant_attn``) where :func:`kvkit.kernels.dispatch.use_triton` says so for q and the view's tensors and
    no launch has failed in this process; otherwise the torch path named by ``torch_path``: ``"reference"`` (the
    torch reference ``reference.decode_ref``, fp32 math) or ``"caller"`` (return None: the caller reads the same
    slots its own way, e.g. a store's SDPA read, whose rounding the eager CPU results keep). A Triton launch that
    raises is recorded once (:func:`kvkit.kernels.dispatch.record_launch_failure`, one warning) and the torch path
    serves this call and the rest of the process.

    No host synchronisation and fixed shapes: checks look at shapes, dtypes and devices only (``KVKIT_DEBUG=1``
    adds a range check that syncs), and the split-K factor depends on shapes only, so a step can be captured
    by CUDA graphs or ``torch.compile(fullgraph=True)``. Traced by ``torch.compile``, the read is one opaque operator
    per part (``torch.ops.kvkit.view_decode`` / ``packed_decode``, :mod:`.decode_op`) that picks the same path when
    the graph runs. ``num_splits``: split-K factor of the Triton kernels (default: sized to the device).
    """
    if torch_path not in TORCH_PATHS:
        raise ValueError(f"kvkit.kernels.decode: torch_path must be one of {', '.join(TORCH_PATHS)}, got "
                         f"{torch_path!r}")
    caller = torch_path == "caller"
    if caller and (launch_failed() is not None or not use_triton(q)):
        return None  # no kernel reads the view: it is not built
    if callable(view):
        view = view()
    q3, squeeze = check_view("decode", q, view)
    triton = launch_failed() is None and use_triton(q, *view.tensors())
    if caller and not triton:
        return None
    scale = default_scale(scale, q3.shape[-1])
    if debug():
        check_view_ranges("decode", view)
    if torch.compiler.is_compiling():
        out, lse = compiled_decode(q3, view, scale, num_splits)
    elif triton:
        try:
            out, lse = _launch(q3, view, scale, num_splits)
        except Exception as e:  # noqa: BLE001 - any launch failure means the same: the torch path serves
            record_launch_failure(e)
            if caller:
                return None
            out, lse = _ref.decode_ref(q3, view, scale=scale)
    else:
        out, lse = _ref.decode_ref(q3, view, scale=scale)
    out = out.to(q.dtype) if squeeze else out.to(q.dtype)[:, :, None]
    return (out, lse) if return_lse else out


def _launch(q3, view, scale, num_splits):
    """The fused split-K Triton kernel over ``view`` on q's device: ``(out [B, Hq, D], lse [B, Hq] fp32)``."""
    from .fused_decode import decode_triton  # Triton: imported when a Triton kernel is about to run

    with on_device(q3):
        return decode_triton(q3, view, scale=scale, num_splits=num_splits)


__all__ = ["TORCH_PATHS", "decode"]
