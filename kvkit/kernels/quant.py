"""Group-wise asymmetric int8 / int4 / int2 quantisation of KV tensors (KIVI / ZipCache layouts).

Layout of :class:`Packed` for ``x [..., N, D]`` (N tokens, D channels):

* ``data`` uint8 ``[..., N, D*bits/8]``, exactly ``bits/8`` bytes per element. With ``P = 8/bits`` values
  per byte and ``DB = D/P`` bytes per token, byte ``b`` holds channels ``b, b + DB, ..., b + (P-1)*DB``
  at bit offsets ``0, bits, ...``: unpacking byte column ``b`` with one shift gives a contiguous block
  of DB channels, which the decode kernel feeds to its dots without any register shuffle.
* ``axis=-2`` (keys, "channel-wise"): statistics per channel, groups of ``group_size`` tokens along N
  (``group_size=None``: one group over all N tokens, ZipCache's per-channel min/scale):
  ``scale, zero [..., ceil(N/group_size), D]``.
* ``axis=-1`` (values, "token-wise"): statistics per token, groups of ``group_size`` channels:
  ``scale, zero [..., N, D/group_size]``.
* ``x ~= q * scale + zero`` with ``q`` in ``[0, 2**bits - 1]`` (``zero`` = group minimum).
* ``channel_prescale=True`` (ZipCache values): ``c = sqrt(max_n |x|)`` per channel (``prescale
  [..., 1, D]``), ``x / c`` is quantised, dequantisation multiplies by ``c`` again.

Packing runs in torch on any device (it happens at prefill / re-quantisation time); decode attention
reads the packed store directly in ``quant_attn.py`` (Triton) or via :func:`dequantize` (reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BITS = (2, 4, 8)


@dataclass(slots=True)
class Packed:
    """A quantised tensor: see the module docstring for the layout."""

    data: torch.Tensor  # uint8 [..., N, D*bits//8]
    scale: torch.Tensor  # [..., ceil(N/G), D] (axis=-2) or [..., N, D/G] (axis=-1)
    zero: torch.Tensor  # same shape as scale: the group minimum
    bits: int
    group_size: int  # effective group size (tokens for axis=-2, channels for axis=-1)
    axis: int  # -2: channel-wise stats (keys), -1: token-wise stats (values)
    shape: tuple  # the original shape [..., N, D]
    dtype: torch.dtype  # the original dtype (default of dequantize)
    prescale: torch.Tensor | None = None  # [..., 1, D] fp32 channel pre-scale c (ZipCache values)
    #: the CPU kernel's cached (pointers, fp32 statistics) of this pack; not copied by ``dataclasses.replace``
    cpu_view: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return packed_nbytes(self)


def packed_nbytes(p: Packed) -> int:
    """Exact bytes held: packed codes (bits/8 per element) + scales + zeros (+ pre-scales)."""
    n = p.data.numel() * p.data.element_size() + p.scale.numel() * p.scale.element_size()
    n += p.zero.numel() * p.zero.element_size()
    if p.prescale is not None:
        n += p.prescale.numel() * p.prescale.element_size()
    return n


def _err(msg):
    raise ValueError(f"kvkit.kernels.quantize: {msg}")


def quantize(x: torch.Tensor, bits: int, group_size: int | None = None, axis: int = -1, *,
             channel_prescale: bool = False, stat_dtype: torch.dtype | None = None) -> Packed:
    """Quantise ``x [..., N, D]`` to ``bits`` (8, 4 or 2) with group-wise scale and zero point.

    axis: -1 token-wise (groups of ``group_size`` channels, default D) or -2 channel-wise (groups of
    ``group_size`` tokens, default N). ``stat_dtype``: dtype of scale/zero, default fp16 for 16-bit
    inputs and fp32 otherwise; fp16 (default or asked for) becomes fp32 where values exceed fp16's range.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        _err(f"x must be a float tensor [..., N, D], got {getattr(x, 'shape', type(x))}")
    if bits not in BITS:
        _err(f"bits must be one of {BITS}, got {bits!r}")
    if axis not in (-1, -2, x.dim() - 1, x.dim() - 2):
        _err(f"axis must be -1 (token-wise) or -2 (channel-wise), got {axis}")
    axis = -1 if axis in (-1, x.dim() - 1) else -2
    *lead, N, D = x.shape
    ppb = 8 // bits
    if D % ppb:
        _err(f"the channel dim D={D} must be a multiple of {ppb} to pack {bits}-bit values into bytes")
    G = int(group_size) if group_size else (D if axis == -1 else max(N, 1))
    if G < 1 or (axis == -1 and D % G):
        _err(f"group_size {group_size} must divide D={D} for token-wise (axis=-1) quantisation")
    xf = x.float()
    if stat_dtype is None:
        stat_dtype = torch.float16 if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
    if stat_dtype == torch.float16 and xf.numel() and float(xf.abs().amax()) > 6.0e4:
        stat_dtype = torch.float32  # beyond fp16's range (asked for or by default): fp32 statistics
    pre = None
    if channel_prescale:
        c = xf.abs().amax(dim=-2, keepdim=True).sqrt()  # [..., 1, D]
        pre = torch.where(c > 0, c, torch.ones_like(c))
        xf = xf / pre
    qmax = (1 << bits) - 1
    if axis == -1:
        xg = xf.view(*lead, N, D // G, G)
        mn, mx = xg.amin(dim=-1), xg.amax(dim=-1)  # [..., N, D/G]
    else:
        NG = -(-N // G)
        pad = NG * G - N
        lo = torch.nn.functional.pad(xf, (0, 0, 0, pad), value=float("inf")).view(*lead, NG, G, D)
        hi = torch.nn.functional.pad(xf, (0, 0, 0, pad), value=float("-inf")).view(*lead, NG, G, D)
        mn, mx = lo.amin(dim=-2), hi.amax(dim=-2)  # [..., NG, D]
    zero = mn.to(stat_dtype)
    scale = ((mx - zero.float()) / qmax).to(stat_dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: any step, q = 0
    sf, zf = _expand(scale.float(), axis, G, N), _expand(zero.float(), axis, G, N)
    q = torch.round((xf - zf) / sf).clamp_(0, qmax).to(torch.uint8)
    q = q.view(*lead, N, ppb, D // ppb)  # channel j*DB + b -> [j, b]
    shifts = torch.arange(0, 8, bits, device=x.device, dtype=torch.uint8).view(ppb, 1)
    data = (q << shifts).sum(dim=-2, dtype=torch.uint8) if ppb > 1 else q[..., 0, :]
    return Packed(data.contiguous(), scale.contiguous(), zero.contiguous(), bits, G, axis, tuple(x.shape), x.dtype,
                  None if pre is None else pre.contiguous())


def _expand(stat, axis, G, N):
    """Broadcast per-group stats to ``[..., N, D]``."""
    if axis == -1:
        return stat.repeat_interleave(G, dim=-1)
    return stat.repeat_interleave(G, dim=-2)[..., :N, :]


def unpack_codes(p: Packed) -> torch.Tensor:
    """The integer codes ``[..., N, D]`` (uint8) of a :class:`Packed`."""
    ppb = 8 // p.bits
    if ppb == 1:
        return p.data
    shifts = torch.arange(0, 8, p.bits, device=p.data.device, dtype=torch.uint8).view(ppb, 1)
    q = (p.data[..., None, :] >> shifts) & ((1 << p.bits) - 1)  # [..., N, P, DB]
    return q.flatten(-2)


def dequantize(p: Packed, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Back to floats ``p.shape`` (``dtype`` default: the original dtype); math in fp32."""
    N = p.shape[-2]
    x = unpack_codes(p).float() * _expand(p.scale.float(), p.axis, p.group_size, N)
    x = x + _expand(p.zero.float(), p.axis, p.group_size, N)
    if p.prescale is not None:
        x = x * p.prescale.float()
    return x.to(dtype or p.dtype)
