"""Quantized-segment store: packed segments + a full-precision tail, attended together through their LSE.

What a quantizer supplies (everything else is here):

* :meth:`QuantizedSegmentStore.split_block` -- which tokens of a block get which bits: a list of
  :class:`Group` (key bits, value bits, token indices per (row, KV head), valid count per row);
  :func:`rank_groups` builds them from a score (highest score first), the default is one group at
  ``bits`` for every token;
* :meth:`QuantizedSegmentStore.quantize_group` -- how a group is packed: by default keys per channel
  (one min/scale per channel over the group's tokens) and values per token (optionally divided by a
  per-channel pre-scale ``sqrt(max |V|)`` first), both with :func:`kvkit.kernels.quantize`;
* optionally :meth:`~QuantizedSegmentStore.tail_score` (the score handed to ``split_block`` when the tail is
  compressed) and :meth:`~QuantizedSegmentStore.observe` (called after each decode read with the total LSE).

Layout (B rows, H KV heads, D head dim): ``segments`` is a list of :class:`Segment`, one per compression
(the prompt, then every ``tail_tokens`` new tokens); a segment holds one ``(kpack, vpack, length)`` part per
group, ``kpack``/``vpack`` :class:`~kvkit.kernels.Packed` of ``[B, H, m, D]`` and ``length [B]`` int64 the
valid tokens of each row (rows of a group are padded to the longest one by repeating the group's first token,
which leaves per-channel min/max statistics unchanged). Tokens inside a part are in group order, not
position order: every segment is older than every query, so no causal mask is needed inside segments.
The tail is the :class:`~kvkit.stores.SlotStore`'s ``keys``/``values``/``pos`` (uncompressed, with positions).

Decode: the tail goes to :func:`kvkit.stores.attend_slots` with ``return_lse=True`` (causal by position,
padding); all parts of all segments go to :func:`kvkit.kernels.quant_decode` in one call (one softmax over
their union: Triton on CUDA, the packed-code C kernel on CPU, the torch reference otherwise) with the
tail's ``(out, lse)`` as ``prior``, merged through the log-sum-exp. A single-token eager step on the Triton path
(:func:`kvkit.kernels.use_triton`) is instead ONE :func:`kvkit.kernels.decode` call over a
:class:`~kvkit.kernels.DecodeView`: the tail as its own keys (pos/qpos), the packed parts as its ``parts``. Compression of the tail happens only at the start of ``update`` (or right after prefill), so ``crop``
of the tail is exact (the :class:`~kvkit.stores.SlotStore` contract).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kvkit.kernels import DecodeView, Packed, PackedPart, packed_nbytes, quant_decode, quantize
from kvkit.stores.attend import attend_slots, seam_open, seam_view
from kvkit.stores.base import LayerInfo, SlotStore, tensor_bytes


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


class QuantizedSegmentStore(SlotStore):
    """Packed segments + a full-precision tail (see the module docstring).

    Parameters: ``tail_tokens`` -- the tail is quantised into a new segment once it holds this many tokens;
    ``bits`` -- bit width of the default :meth:`split_block` (one group, keys and values); ``value_prescale``
    -- divide values by ``sqrt(max |V|)`` per channel before quantising them (ZipCache's outlier-channel
    handling); ``key_group`` -- tokens per key statistic (KIVI-style groups; None: one per channel per part);
    ``stat_dtype`` -- dtype of the scales and zero points (None: fp16 for 16-bit models, fp32 otherwise).
    """

    def __init__(self, info: LayerInfo, tail_tokens: int, bits: int = 4, value_prescale: bool = False,
                 key_group: int | None = None, stat_dtype: torch.dtype | None = None):
        super().__init__(info)
        self.stat_dtype = stat_dtype
        self.tail_tokens = tail_tokens
        self.bits = bits
        self.value_prescale = value_prescale
        self.key_group = key_group
        self.segments: list[Segment] = []
        self._read = None  # (kpacks, vpacks, valid lengths or None where every row is full): built once per change

    # ---- what a quantizer overrides --------------------------------------------------------------
    def split_block(self, k, v, valid, score) -> list[Group]:
        """Which tokens of a block ``k, v [B, H, n, D]`` (``valid [B, n]``) get which bits. ``score``: what
        :meth:`tail_score` or the caller of :meth:`compress_tail` handed in (None by default)."""
        B, H, n, _ = k.shape
        ones = torch.zeros(B, H, n, device=k.device)
        return rank_groups(ones, valid, (), ((self.bits, self.bits),))

    def quantize_group(self, k, v, key_bits: int, value_bits: int) -> tuple[Packed, Packed]:
        """Pack one group ``k, v [B, H, m, D]``: keys per channel (one statistic per ``key_group`` tokens of the
        group's order, or over all m when None), values per token (optional pre-scale)."""
        kp = quantize(k, key_bits, self.key_group if self.key_group and self.key_group < k.shape[-2] else None,
                      axis=-2, stat_dtype=self.stat_dtype)
        vp = quantize(v, value_bits, None, axis=-1, channel_prescale=self.value_prescale, stat_dtype=self.stat_dtype)
        return kp, vp

    def tail_score(self):
        """The score of the tail's tokens handed to :meth:`split_block` at a compression (None: none)."""
        return None

    def observe(self, query, qpos, scaling, lse) -> None:
        """Called after every decode read with the LSE ``[B, Hq, T]`` of the queries over everything held."""

    # ---- storage ---------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.segments = []
        self._read = None

    def _apply_batch(self, fn) -> None:
        super()._apply_batch(fn)
        for seg in self.segments:
            seg.parts = [(map_packed(k, fn), map_packed(v, fn), fn(n)) for k, v, n in seg.parts]
        self._read = None

    def nbytes(self) -> int:
        n = tensor_bytes(self.keys, self.values, self.pos, self.first_pos)
        for seg in self.segments:
            for k, v, length in seg.parts:
                n += packed_nbytes(k) + packed_nbytes(v) + tensor_bytes(length)
        return n

    def num_slots(self) -> int:
        tail = 0 if self.keys is None else self.keys.shape[-2]
        return tail + self.quantized_tokens()

    def quantized_tokens(self) -> int:
        return sum(seg.tokens() for seg in self.segments)

    def parts(self) -> list:
        """Every ``(kpack, vpack, length)`` part of every segment, oldest first."""
        return [p for seg in self.segments for p in seg.parts]

    # ---- compression -----------------------------------------------------------------------------
    def quantize_block(self, k, v, valid, score=None) -> Segment:
        """``k, v [B, H, n, D]``, ``valid [B, n]`` bool -> a :class:`Segment` (one part per group)."""
        B, H, n, D = k.shape
        parts = []
        for g in self.split_block(k, v, valid, score):
            gi = g.idx[..., None].expand(*g.idx.shape, D)
            kp, vp = self.quantize_group(k.gather(2, gi), v.gather(2, gi), g.key_bits, g.value_bits)
            parts.append((kp, vp, g.count))
        return Segment(parts)

    def compress_tail(self, score=None) -> None:
        """Quantise the whole tail into a new segment and empty the tail."""
        if self.keys is None or self.keys.shape[-2] == 0:
            return
        valid = self.pos[:, 0] >= 0
        self.segments.append(self.quantize_block(self.keys, self.values, valid, score))
        self._build_read()
        self.keys = self.keys[..., :0, :]
        self.values = self.values[..., :0, :]
        self.pos = self.pos[..., :0]

    def on_prefill(self, query, module) -> None:
        self.compress_tail(self.tail_score())

    def should_compress(self) -> bool:
        return self.keys.shape[-2] >= self.tail_tokens

    def compress(self) -> None:
        self.compress_tail(self.tail_score())

    def _build_read(self) -> None:
        """What decode reads from the segments: the packed parts and their lengths (None where every row holds
        the whole part). Built at a compression event (it reads the lengths on the host), reused by every step."""
        parts = self.parts()
        self._read = ([k for k, _, _ in parts], [v for _, v, _ in parts],
                      [None if int(n.min()) >= k.shape[-2] else n for k, _, n in parts]) if parts else None

    # ---- attention -------------------------------------------------------------------------------
    def decode(self, query, qpos, scaling):
        """Queries ``[B, Hq, T, D]`` at ``qpos [T]`` over every segment (all older than the queries) and the
        tail (causal by position); returns ``[B, T, Hq, D]``."""
        B, Hq, T, D = query.shape
        if self._read is None and self.segments:
            self._build_read()
        r = self._seam_decode(query, qpos, scaling)
        if r is not None:
            out, lse = r
            self.observe(query, qpos, scaling, lse)
            return out
        out = lse = None
        if self.keys is not None and self.keys.shape[-2]:
            o, lse = attend_slots(query, self.keys, self.values, self.pos, qpos, scaling, return_lse=True,
                                  dense=self.dense_decode(T))
            out = o.transpose(1, 2)
        if self._read is not None:  # the tail's partial attention is merged in by quant_decode (prior=...)
            ks, vs, ns = self._read
            out, lse = quant_decode(query, ks, vs, scale=scaling, valid=ns, return_lse=True,
                                    prior=None if out is None else (out, lse))
        if out is None:
            return query.new_zeros(B, T, Hq, D)
        self.observe(query, qpos, scaling, lse)
        return out.transpose(1, 2)

    def _seam_decode(self, query, qpos, scaling):
        """A single-token eager step on the Triton path: ONE :func:`kvkit.kernels.decode` call over a
        :class:`~kvkit.kernels.DecodeView` whose own keys are the tail (causal by pos/qpos) and whose parts are the
        segments' packed parts (:class:`~kvkit.kernels.PackedPart`, with their lengths). Returns
        ``(out [B, 1, Hq, D], lse [B, Hq, 1])``, or None where the seam does not apply (the caller's path runs)."""
        tail = self.keys is not None and self.keys.shape[-2] > 0
        if not (tail or self._read is not None):
            return None
        held = (self.keys, self.values) if tail else ()
        packed = [p.data for p in self._read[0] + self._read[1]] if self._read is not None else []
        if not seam_open(query, *held, *packed):
            return None
        parts = ()
        if self._read is not None:
            ks, vs, ns = self._read
            parts = tuple(PackedPart(k, v, n) for k, v, n in zip(ks, vs, ns))
        if tail:
            dense = self.dense_decode(1)
            view = DecodeView(self.keys, self.values, pos=None if dense else self.pos,
                              qpos=None if dense else qpos[-1], parts=parts)
        else:
            view = DecodeView(None, None, parts=parts)
        r = seam_view(query, view, scaling)
        return None if r is None else (r[0][:, None], r[1][:, :, None])


__all__ = ["Group", "Segment", "QuantizedSegmentStore", "rank_groups", "map_packed"]
