"""The packed blocks a quantized store holds: :class:`Segment` (one quantised block, one part per group of tokens
quantised together, :class:`Group`), :func:`rank_groups` (a block's tokens split by score into precision groups) and
the batch-dim operations on :class:`~kvkit.kernels.Packed` blocks (select rows, concatenate, zero, compare layouts)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kvkit.kernels import Packed


class Group(NamedTuple):
    """Tokens of a block quantised together: ``idx [B, H, m]`` token indices into the block (per row and KV
    head), ``count [B]`` int64 valid entries per row (the rest of ``idx`` is padding), key and value bits."""

    key_bits: int
    value_bits: int
    idx: torch.Tensor
    count: torch.Tensor


@dataclass
class Segment:
    """One quantised block of tokens: one ``(kpack, vpack, length [B])`` part per non-empty group."""

    parts: list
    #: a static store's preallocated segment: written in place at a compression, every part's length 0 until then
    slot: bool = False

    def tokens(self) -> int:
        return sum(int(n.max()) for _, _, n in self.parts)


def map_packed(p: Packed, fn) -> Packed:
    """``fn`` applied along the batch dim of every tensor of ``p`` (beam reorder, batch select)."""
    pre = None if p.prescale is None else fn(p.prescale)
    data = fn(p.data)
    return replace(p, data=data, scale=fn(p.scale), zero=fn(p.zero), prescale=pre,
                   shape=(data.shape[0], *p.shape[1:]))


def rank_groups(score, valid, fractions, bits) -> list[Group]:
    """Split a block's tokens by rank of ``score [B, H, n]`` (highest first; padding, ``valid [B, n]`` False,
    always last): group i takes the next ``ceil(n_real * fractions[i])`` tokens of each row (clipped to what is
    left), the last group the rest. ``bits``: one ``(key_bits, value_bits)`` per group (``len(fractions) + 1``).
    Empty groups are dropped."""
    if len(bits) != len(fractions) + 1:
        raise ValueError(f"rank_groups: {len(fractions)} fractions need {len(fractions) + 1} bit settings, got {len(bits)}")
    B, H, n = score.shape
    n_real = valid.sum(-1)  # [B]
    order = score.float().masked_fill(~valid[:, None, :], float("-inf")).argsort(dim=-1, descending=True, stable=True)
    start = torch.zeros_like(n_real)
    groups = []
    for i, (kb, vb) in enumerate(bits):
        left = n_real - start
        if i < len(fractions):
            count = torch.ceil(n_real.double() * fractions[i] - 1e-9).long().clamp(min=0)
            count = torch.minimum(count, left)
        else:
            count = left
        m = int(count.max()) if count.numel() else 0
        if m > 0:
            j = torch.arange(m, device=score.device)
            src = (start[:, None] + j).clamp(max=n - 1)  # [B, m]
            first = start.clamp(max=n - 1)[:, None].expand(B, m)
            src = torch.where(j[None] < count[:, None], src, first)  # padding repeats the group's first token
            groups.append(Group(kb, vb, order.gather(-1, src[:, None, :].expand(B, H, m)), count.clone()))
        start = start + count
    return groups


def rows_of(p: Packed, rows: slice) -> Packed:
    """The rows ``rows`` (batch dim) of every tensor of ``p``: views, so writes reach ``p``."""
    return map_packed(p, lambda t: t[rows])


def cat_packed(ps: list) -> Packed:
    """Packed blocks of one layout concatenated along the batch dim (new tensors)."""
    pre = None if ps[0].prescale is None else torch.cat([p.prescale for p in ps])
    data = torch.cat([p.data for p in ps])
    return replace(ps[0], data=data, scale=torch.cat([p.scale for p in ps]), zero=torch.cat([p.zero for p in ps]),
                   prescale=pre, shape=(data.shape[0], *ps[0].shape[1:]))


def zeroed(p: Packed) -> Packed:
    """A packed block of ``p``'s layout holding zeros (codes, statistics; pre-scale 1): dequantizes to 0."""
    pre = None if p.prescale is None else torch.ones_like(p.prescale)
    return replace(p, data=torch.zeros_like(p.data), scale=torch.zeros_like(p.scale), zero=torch.zeros_like(p.zero),
                   prescale=pre)


def same_layout(a: Segment, b: Segment) -> bool:
    """Whether two segments' parts have the same packed shapes, dtypes and bit widths (one can be written into
    the other)."""
    def layout(seg):
        return [(p.bits, p.group_size, p.axis, tuple(t.shape), t.dtype) for k, v, _ in seg.parts for p in (k, v)
                for t in (p.data, p.scale, p.zero)] + [n.shape for _, _, n in seg.parts]
    return len(a.parts) == len(b.parts) and layout(a) == layout(b)


__all__ = ["Group", "Segment", "cat_packed", "map_packed", "rank_groups", "rows_of", "same_layout", "zeroed"]
