"""The decode seam: what one decode step reads, as fixed-capacity device tensors.

A KV store describes its decode read as a :class:`DecodeView`; :func:`kvkit.kernels.decode` attends one
query token per row over it. Everything a view carries is a device tensor whose *shape* is fixed between
compression events (capacity, not occupancy): how much is held, which slots are read and which are causally
visible live in tensors (``length``, ``index``, ``pos``/``qpos``), never in Python ints or in slicing, so a
decode step makes no host synchronisation and can be captured by CUDA graphs / ``torch.compile(fullgraph=True)``.

Shapes: B rows, H KV heads, cap slots per (row, head), D head dim, K listed slots per (row, head).

A slot ``s`` of (row b, KV head h) is read when all of these hold (each only when its field is given):

* ``0 <= s < cap`` (always; with ``index``, ``s = index[b, h, j]`` and -1 / out-of-range entries read nothing),
* ``s < length[b, h]`` (or ``length[b]``): slots ``[0, length)`` are held, the rest is free capacity,
* ``0 <= pos[b, h or 0, s] <= qpos[b]``: causal visibility (pos -1 marks padding / a dead slot),
* and its score is ``scale * q.k[s] + log_weight[b, h, s]`` (``-inf`` hides the key).

``parts``: further views (:class:`DecodeView`, :class:`PackedPart`) over disjoint key sets of the same rows
and heads; the result is attention over the union, merged by log-sum-exp. A view with ``k = v = None`` is a
pure container of parts. Low-rank keys (ShadowKV) have no part kind yet: they go through
:func:`kvkit.kernels.lowrank_decode` and :func:`kvkit.kernels.merge_attn`; any other object in ``parts`` is
rejected with a ValueError.

Kernels: :func:`kvkit.kernels.fused_decode.decode_triton` (Triton) and
:func:`kvkit.kernels.reference.decode_ref` (torch, the CPU path).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from ._common import FLOATS, INTS, check_range, check_tensor, fail
from .quant import Packed


@dataclass(slots=True)
class DecodeView:
    """Fixed-capacity keys/values of one layer plus what a decode step reads of them.

    k, v : ``[B, H, cap, D]`` fp16 / bf16 / fp32 (q's dtype), or both None (the view only holds ``parts``).
    length : ``[B, H]`` or ``[B]`` int32/int64, or None (all ``cap`` slots held).
    index : ``[B, H, K]`` int32/int64 slot ids to read (gathered inside the kernel; -1 = none), or None (all).
    pos : ``[B, Hp, cap]`` int32/int64 (Hp = 1 or H) absolute position of each slot, -1 = padding / dead;
        given together with ``qpos`` (``[B]`` or 0-d int tensor, the query's position).
    log_weight : ``[B, H, cap]`` float additive score term in natural-log units (e.g. log cluster size), or None.
    parts : tuple of :class:`DecodeView` / :class:`PackedPart` over other keys, merged by log-sum-exp.
    """

    kind: ClassVar[str] = "dense"

    k: torch.Tensor | None
    v: torch.Tensor | None
    length: torch.Tensor | None = None
    index: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    qpos: torch.Tensor | None = None
    log_weight: torch.Tensor | None = None
    parts: tuple = ()

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the view (and its parts) holds: for device checks and backend choice."""
        for t in (self.k, self.v, self.length, self.index, self.pos, self.qpos, self.log_weight):
            if isinstance(t, torch.Tensor):
                yield t
        for p in self.parts:
            if isinstance(p, (DecodeView, PackedPart)):
                yield from p.tensors()


@dataclass(slots=True)
class PackedPart:
    """Quantized keys and values (:class:`kvkit.kernels.Packed` from :func:`kvkit.kernels.quantize`) of
    ``[B, H, N, D]``; ``length`` ``[B]`` int (tokens ``n >= length[b]`` are not read) or None (all N).
    Read straight from the packed codes by ``quant_attn``'s Triton kernel (the reference dequantizes)."""

    kind: ClassVar[str] = "packed"

    k: Packed
    v: Packed
    length: torch.Tensor | None = None

    def tensors(self) -> Iterator[torch.Tensor]:
        yield self.k.data
        yield self.v.data
        if self.length is not None:
            yield self.length


_PART_HELP = ("supported parts: DecodeView, PackedPart; low-rank keys (ShadowKV) are not a view part yet: "
              "attend them with kvkit.kernels.lowrank_decode and combine with kvkit.kernels.merge_attn")


def check_view(fn: str, q, view) -> tuple[torch.Tensor, bool]:
    """Shape / dtype / device checks of ``q`` and ``view`` (no device values are read).

    q ``[B, Hq, D]`` or ``[B, Hq, 1, D]``. Returns ``(q3 [B, Hq, D], squeeze)`` where ``squeeze`` says q was 3-D.
    """
    check_tensor(fn, "q", q, (3, 4), FLOATS)
    if q.dim() == 4 and q.shape[2] != 1:
        fail(fn, f"decode takes one query token per row: q [B, Hq, D] or [B, Hq, 1, D], got {tuple(q.shape)}")
    q3 = q if q.dim() == 3 else q[:, :, 0]
    if not isinstance(view, DecodeView):
        fail(fn, f"view must be a kvkit.kernels.DecodeView, got {type(view).__name__}")
    _check_dense(fn, q3, view, "view", None)
    return q3, q.dim() == 3


def _check_dense(fn, q3, view, name, H):
    B, Hq, D = q3.shape
    dev = q3.device
    if (view.k is None) != (view.v is None):
        fail(fn, f"{name}.k and {name}.v go together (both tensors, or both None for a container of parts)")
    if view.k is None:
        if not view.parts:
            fail(fn, f"{name} holds nothing: give k/v or parts")
        for field in ("length", "index", "pos", "qpos", "log_weight"):
            if getattr(view, field) is not None:
                fail(fn, f"{name}.{field} needs {name}.k/v (a view without keys only holds parts)")
    else:
        check_tensor(fn, f"{name}.k", view.k, 4, FLOATS, dev)
        check_tensor(fn, f"{name}.v", view.v, 4, FLOATS, dev)
        if not (q3.dtype == view.k.dtype == view.v.dtype):
            fail(fn, f"q, {name}.k, {name}.v must share one dtype, got {q3.dtype}, {view.k.dtype}, {view.v.dtype}")
        if view.k.shape != view.v.shape:
            fail(fn, f"{name}.k {tuple(view.k.shape)} and {name}.v {tuple(view.v.shape)} must both be [B, H, cap, D]")
        Bk, Hk, cap, Dk = view.k.shape
        if Bk != B or Dk != D:
            fail(fn, f"{name}.k/v {tuple(view.k.shape)} do not match q {tuple(q3.shape)} (batch and head_dim must agree)")
        if Hk == 0 or Hq % Hk:
            fail(fn, f"query heads ({Hq}) must be a multiple of {name}'s KV heads ({Hk})")
        if H is not None and Hk != H:
            fail(fn, f"{name} has {Hk} KV heads but the enclosing view has {H}")
        H = Hk
        if view.length is not None:
            check_tensor(fn, f"{name}.length", view.length, (1, 2), INTS, dev)
            if tuple(view.length.shape) not in ((B,), (B, H)):
                fail(fn, f"{name}.length must be [B={B}] or [B={B}, H={H}], got {tuple(view.length.shape)}")
        if view.index is not None:
            check_tensor(fn, f"{name}.index", view.index, 3, INTS, dev)
            if tuple(view.index.shape[:2]) != (B, H):
                fail(fn, f"{name}.index must be [B={B}, H={H}, K], got {tuple(view.index.shape)}")
        if (view.pos is None) != (view.qpos is None):
            fail(fn, f"{name}.pos and {name}.qpos go together (slot positions and the query's position)")
        if view.pos is not None:
            check_tensor(fn, f"{name}.pos", view.pos, 3, INTS, dev)
            if view.pos.shape[0] != B or view.pos.shape[1] not in (1, H) or view.pos.shape[2] != cap:
                fail(fn, f"{name}.pos must be [B={B}, 1 or H={H}, cap={cap}], got {tuple(view.pos.shape)}")
            check_tensor(fn, f"{name}.qpos", view.qpos, (0, 1), INTS, dev)
            if view.qpos.dim() == 1 and view.qpos.shape[0] not in (1, B):
                fail(fn, f"{name}.qpos must be [B={B}] or a 0-d tensor, got {tuple(view.qpos.shape)}")
        if view.log_weight is not None:
            check_tensor(fn, f"{name}.log_weight", view.log_weight, 3, FLOATS, dev)
            if tuple(view.log_weight.shape) != (B, H, cap):
                fail(fn, f"{name}.log_weight must be [B={B}, H={H}, cap={cap}], got {tuple(view.log_weight.shape)}")
    if not isinstance(view.parts, (tuple, list)):
        fail(fn, f"{name}.parts must be a tuple of views, got {type(view.parts).__name__}")
    for i, part in enumerate(view.parts):
        pname = f"{name}.parts[{i}]"
        if isinstance(part, DecodeView):
            H = _check_dense(fn, q3, part, pname, H)
        elif isinstance(part, PackedPart):
            H = _check_packed(fn, q3, part, pname, H)
        else:
            fail(fn, f"{pname} is a {type(part).__name__}, which decode cannot read; {_PART_HELP}")
    return H


def _check_packed(fn, q3, part, name, H):
    B, Hq, D = q3.shape
    for side in ("k", "v"):
        p = getattr(part, side)
        if not isinstance(p, Packed):
            fail(fn, f"{name}.{side} must be a kvkit.kernels.Packed (from quantize), got {type(p).__name__}")
        if len(p.shape) != 4:
            fail(fn, f"{name}.{side} must pack a [B, H, N, D] tensor, got shape {tuple(p.shape)}")
        if p.data.device != q3.device:
            fail(fn, f"{name}.{side} is on {p.data.device} but q is on {q3.device}")
    if tuple(part.k.shape) != tuple(part.v.shape):
        fail(fn, f"{name}.k {tuple(part.k.shape)} and {name}.v {tuple(part.v.shape)} must pack the same [B, H, N, D]")
    Bp, Hp, N, Dp = part.k.shape
    if Bp != B or Dp != D or Hp == 0 or Hq % Hp:
        fail(fn, f"{name} packs {tuple(part.k.shape)}, which does not match q {tuple(q3.shape)} (B, D, Hq % H == 0)")
    if H is not None and Hp != H:
        fail(fn, f"{name} has {Hp} KV heads but the enclosing view has {H}")
    if part.length is not None:
        check_tensor(fn, f"{name}.length", part.length, 1, INTS, q3.device)
        if part.length.shape[0] != B:
            fail(fn, f"{name}.length must be [B={B}], got {tuple(part.length.shape)}")
    return Hp


def check_view_ranges(fn: str, view) -> None:
    """``KVKIT_DEBUG=1`` only (reads device values): index entries in ``[-1, cap)``, lengths in ``[0, cap]``."""
    if view.k is not None:
        cap = view.k.shape[2]
        if view.index is not None:
            check_range(fn, "view.index", view.index, cap)
        if view.length is not None and view.length.numel():
            lo, hi = int(view.length.min()), int(view.length.max())
            if lo < 0 or hi > cap:
                raise IndexError(f"kvkit.kernels.{fn}: view.length out of range: found values in [{lo}, {hi}], "
                                 f"allowed [0, cap={cap}]")
    for part in view.parts:
        if isinstance(part, DecodeView):
            check_view_ranges(fn, part)
