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

Static variant (``static_store(<a subclass>)``, ``info.static``): the tail lives in static buffers of
``tail_tokens`` slots, and the segments of decoded tokens go to *slot segments* preallocated at the prefill, one per
``tail_tokens`` of the room the cache was sized for (``max_length`` / ``ensure_capacity``): each holds the parts of
a full tail's layout with ``length`` 0 until a compression writes a block's codes and statistics into it in place.
The slot segments are stacked in one *area* per part (``S`` segments = ``S * B`` rows in the batch dim, each
segment with its own statistics), read by one call with the queries repeated per segment and the ``S`` partial
results merged by log-sum-exp: a compiled step reads the whole area (the same tensors after every compression: one
graph, one operator per part whatever the room), an eager step only the rows of the segments written so far. When
the slot segments run out their number doubles (one re-trace), and a block of another layout (an eager
multi-token forward) is appended as an ordinary segment.

Decode: the tail goes to :func:`kvkit.stores.attend_slots` with ``return_lse=True`` (causal by position,
padding); all parts of the other segments go to :func:`kvkit.kernels.quant_decode` in one call (one softmax over
their union: Triton on CUDA, the packed-code C kernel on CPU, the torch reference otherwise) with the
tail's ``(out, lse)`` as ``prior``, merged through the log-sum-exp. A single-token step is first offered to
:func:`kvkit.kernels.decode` as ONE :class:`~kvkit.kernels.DecodeView` (the tail as its own keys, pos/qpos, the
packed parts as its ``parts``): where the kernels package picks Triton (and in every compiled step) that call is the
whole read; elsewhere it hands the read back and the path above runs. Compression of the tail happens only at the start of ``update`` (or right after prefill), so ``crop``
of the tail is exact (the :class:`~kvkit.stores.SlotStore` contract).
"""

from __future__ import annotations

import torch

from kvkit.kernels import (
    DecodeView,
    Packed,
    PackedPart,
    decode,
    merge_attn,
    merge_partials,
    packed_nbytes,
    quant_decode,
    quantize,
)
from kvkit.stores.attend import attend_slots, seam_view
from kvkit.stores.base import LayerInfo, SlotStore
from kvkit.stores.layer import tensor_bytes
from kvkit.stores.segments import (
    Group,
    Segment,
    cat_packed,
    map_packed,
    rank_groups,
    rows_of,
    same_layout,
    zeroed,
)


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
        self._read = None  # (base parts, stacked slot area) a compiled step reads: built once per change (_build_read)
        self._read_eager = None  # the same with the written slot segments' rows only
        self._area: list = []  # a static store's slot segments stacked, one (kpack, vpack, length) per part
        self._slots_used = 0  # slot segments written (static variant)

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
        self._read = self._read_eager = None
        self._area = []
        self._slots_used = 0

    def _apply_batch(self, fn) -> None:
        super()._apply_batch(fn)
        for seg in self.segments:
            seg.parts = [(map_packed(k, fn), map_packed(v, fn), fn(n)) for k, v, n in seg.parts]
        self._stack_slots()  # the slot segments' new tensors back into one area
        self._read = self._read_eager = None

    def nbytes(self) -> int:
        """Bytes held: the tail and every written segment (a static store's unwritten slot segments are
        :meth:`allocated_nbytes` only)."""
        return tensor_bytes(self.keys, self.values, self.pos, self.first_pos) + self._segment_bytes(written=True)

    def _slot_segments(self) -> list[Segment]:
        """A static store's preallocated segments, oldest first (written ones before the others)."""
        return [s for s in self.segments if s.slot]

    def _segment_bytes(self, written: bool) -> int:
        slots = self._slot_segments()
        skip = {id(s) for s in slots[self._slots_used:]} if written else set()
        return sum(packed_nbytes(k) + packed_nbytes(v) + tensor_bytes(length)
                   for seg in self.segments if id(seg) not in skip for k, v, length in seg.parts)

    def off_slot_nbytes(self) -> int:
        """Every segment's bytes, unwritten slot segments included (a static store's allocation beyond its slots)."""
        return self._segment_bytes(written=False)

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
        """Quantise the whole tail into a new segment (a static store: into its next slot segment) and empty the
        tail."""
        if self.keys is None or self.keys.shape[-2] == 0:
            return
        valid = self.pos[:, 0] >= 0
        seg = self.quantize_block(self.keys, self.values, valid, score)
        if not self._place(seg):
            self.segments.append(seg)
        self._build_read()
        self.keys = self.keys[..., :0, :]
        self.values = self.values[..., :0, :]
        self.pos = self.pos[..., :0]

    def on_prefill(self, query, module) -> None:
        self.compress_tail(self.tail_score())
        self.reserve_segments()

    # ---- static variant: slot segments -----------------------------------------------------------
    def reserve_segments(self, count: int | None = None) -> None:
        """Static stores: preallocate ``count`` more slot segments (default: one per ``tail_tokens`` of the room
        asked for beyond the tokens seen -- ``max_length`` / ``ensure_capacity`` -- at least 2), each with the
        layout of a full tail's block (:meth:`quantize_block` of zeros; every part's length 0), all of them in one
        stacked area (:meth:`_stack_slots`). No-op otherwise."""
        if not self.static or self.keys is None:
            return
        if count is None:
            want = max(self.info.max_length or 0, getattr(self, "tokens_wanted", 0))
            count = max(2, -(-(want - self.seen) // self.tail_tokens))
        B, H, _, D = self.keys.shape
        n = self.tail_tokens
        z = torch.zeros(B, H, n, D, dtype=self.keys.dtype, device=self.keys.device)
        valid = torch.ones(B, n, dtype=torch.bool, device=z.device)
        proto = self.quantize_block(z, z, valid, torch.zeros(B, H, n, device=z.device))
        for _ in range(count):
            parts = [(zeroed(k), zeroed(v), torch.zeros_like(m)) for k, v, m in proto.parts]
            self.segments.append(Segment(parts, slot=True))
        self._stack_slots()
        self._build_read()

    def _stack_slots(self) -> None:
        """Put every slot segment's tensors into one stacked area per part: ``_area[g] = (kpack, vpack, length)``
        whose tensors have ``S * B`` rows (slot segment ``i`` is rows ``i*B .. (i+1)*B``), and make each slot
        segment's parts views of its rows. One read then covers every slot segment (:meth:`_stacked_decode`): the
        queries repeated per segment in the batch dim, each segment keeping its own statistics. A copy, run when
        slot segments are added or the batch changes (eager; the next compiled step re-traces)."""
        slots = self._slot_segments()
        if not slots:
            self._area = []
            return
        B = slots[0].parts[0][2].shape[0]
        area = []
        for g in range(len(slots[0].parts)):
            area.append((cat_packed([s.parts[g][0] for s in slots]), cat_packed([s.parts[g][1] for s in slots]),
                         torch.cat([s.parts[g][2] for s in slots])))
        for i, seg in enumerate(slots):
            rows = slice(i * B, (i + 1) * B)
            seg.parts = [(rows_of(k, rows), rows_of(v, rows), n[rows]) for k, v, n in area]
        self._area = area

    def _place(self, seg: Segment) -> bool:
        """Write ``seg`` into the next unwritten slot segment in place (its rows of the stacked area: a compiled
        step's graph reads the same tensors without re-tracing), doubling the slot segments when none is left.
        False (the caller appends it) for a store that is not static or a block whose layout is not a full tail's."""
        slots = self._slot_segments()
        if not slots or not same_layout(slots[0], seg):
            return False
        if self._slots_used == len(slots):
            self.reserve_segments(len(slots))
            slots = self._slot_segments()
        for (kd, vd, nd), (k, v, n) in zip(slots[self._slots_used].parts, seg.parts):
            for d, src in ((kd, k), (vd, v)):
                for name in ("data", "scale", "zero", "prescale"):
                    t = getattr(d, name)
                    if t is not None:
                        t.copy_(getattr(src, name))
                d.cpu_view = None  # the C kernel's cached statistics are stale (here and in the area)
            nd.copy_(n)
        for k, v, _ in self._area:
            k.cpu_view = v.cpu_view = None
        self._slots_used += 1
        return True

    def should_compress(self) -> bool:
        return self.keys.shape[-2] >= self.tail_tokens

    def compress(self) -> None:
        self.compress_tail(self.tail_score())

    def _build_read(self) -> None:
        """What decode reads from the segments, built at a compression event (it reads the lengths on the host) and
        reused by every step: ``(base, stacked)``. ``base``: ``(kpacks, vpacks, lengths)`` of the segments that are
        not slot segments (the prompt's; a length is None where every row holds the whole part), or None.
        ``stacked``: ``[(kpack, vpack, length, S)]``, one per part of the slot area, ``S`` segments stacked.

        Two reads: ``_read``, what a compiled step reads (the whole area, written or not: the graph reads the same
        tensors after every compression), and ``_read_eager``, what an eager step reads (the area's rows of the
        written slot segments only). Compression events run eagerly, between compiled steps, so the eager read is
        rebuilt whenever a slot segment is written; an eager step's cost then follows the tokens held, not the
        room reserved."""
        parts = [(k, v, n) for seg in self.segments if not seg.slot for k, v, n in seg.parts]
        base = ([k for k, _, _ in parts], [v for _, v, _ in parts],
                [None if int(n.min()) >= k.shape[-2] else n for k, _, n in parts]) if parts else None
        S, u = len(self._slot_segments()), self._slots_used
        whole = [(k, v, n, S) for k, v, n in self._area] if S else []
        if u < S:
            B = self._area[0][2].shape[0] // S
            rows = slice(0, u * B)
            written = [(rows_of(k, rows), rows_of(v, rows), n[rows], u) for k, v, n in self._area] if u else []
        else:
            written = whole
        self._read = (base, whole) if base is not None or whole else None
        self._read_eager = (base, written) if base is not None or written else None

    def _segments_read(self):
        """The segments' read for this step: :attr:`_read` while a compiled step is traced, else the eager one."""
        if self._read is None and self.segments:
            self._build_read()
        return self._read if torch.compiler.is_compiling() else self._read_eager

    # ---- attention -------------------------------------------------------------------------------
    def decode(self, query, qpos, scaling):
        """Queries ``[B, Hq, T, D]`` at ``qpos [T]`` over every segment (all older than the queries) and the
        tail (causal by position); returns ``[B, T, Hq, D]``."""
        B, Hq, T, D = query.shape
        read = self._segments_read()
        base, stacked = read if read is not None else (None, [])
        out = lse = None
        r = self._seam_decode(query, qpos, scaling, base)
        if r is not None:
            out, lse = r[0].transpose(1, 2), r[1]  # [B, Hq, 1, D], [B, Hq, 1]
        else:
            if self.keys is not None and self.keys.shape[-2]:
                o, lse = attend_slots(query, self.keys, self.values, self.pos, qpos, scaling, return_lse=True,
                                      dense=self.dense_decode(T))
                out = o.transpose(1, 2)
            if base is not None:  # the tail's partial attention is merged in by quant_decode (prior=...)
                ks, vs, ns = base
                out, lse = quant_decode(query, ks, vs, scale=scaling, valid=ns, return_lse=True,
                                        prior=None if out is None else (out, lse))
        for k, v, n, S in stacked:
            o, s = self._stacked_decode(query, k, v, n, S, scaling)
            out, lse = (o, s) if out is None else merge_attn(out, lse, o, s)
        if out is None:
            return query.new_zeros(B, T, Hq, D)
        self.observe(query, qpos, scaling, lse)
        return out.transpose(1, 2)

    @staticmethod
    def _stacked_decode(query, k, v, n, S, scaling):
        """Queries ``[B, Hq, T, D]`` over ``S`` slot segments stacked in the batch dim (``k, v`` :class:`Packed` of
        ``S * B`` rows, ``n [S * B]`` their lengths): one read with the queries repeated per segment, then the ``S``
        partial results of each row merged by log-sum-exp. Returns ``(out [B, Hq, T, D], lse [B, Hq, T])``; a row
        whose segments are all empty gets zeros and ``-inf``."""
        B, Hq, T, D = query.shape
        qs = query.repeat(S, 1, 1, 1)  # rows i*B .. (i+1)*B read slot segment i
        if torch.compiler.is_compiling():  # one operator in the compiled graph (packed_decode over S*B rows)
            o, s = decode(qs[:, :, 0], DecodeView(None, None, parts=(PackedPart(k, v, n),)), scale=scaling,
                          return_lse=True)
            o, s = o[:, :, None], s[:, :, None]
        else:
            o, s = quant_decode(qs, k, v, scale=scaling, valid=n, return_lse=True)
        return merge_partials(o.view(S, B, Hq, T, -1), s.view(S, B, Hq, T))

    def _seam_decode(self, query, qpos, scaling, base):
        """A single-token eager step on the Triton path (and every compiled step): ONE
        :func:`kvkit.kernels.decode` call over a :class:`~kvkit.kernels.DecodeView` whose own keys are the tail
        (causal by pos/qpos) and whose parts are the base segments' packed parts (:class:`~kvkit.kernels.PackedPart`,
        with their lengths); the slot area is read after it (:meth:`_stacked_decode`). Returns
        ``(out [B, 1, Hq, D], lse [B, Hq, 1])``, or None where the seam does not apply (the caller's path runs)."""
        tail = self.keys is not None and self.keys.shape[-2] > 0
        if not (tail or base is not None):
            return None

        def view():
            parts = ()
            if base is not None:
                ks, vs, ns = base
                parts = tuple(PackedPart(k, v, n) for k, v, n in zip(ks, vs, ns))
            if tail:
                dense = self.dense_decode(1)
                return DecodeView(self.keys, self.values, pos=None if dense else self.pos,
                                  qpos=None if dense else qpos[-1], parts=parts)
            return DecodeView(None, None, parts=parts)

        # a compiled step (static variant) always reads through the seam: its operators pick the path at run time
        r = seam_view(query, view, scaling, "reference" if torch.compiler.is_compiling() else "caller")
        return None if r is None else (r[0][:, None], r[1][:, :, None])


__all__ = ["Group", "Segment", "QuantizedSegmentStore", "rank_groups", "map_packed"]
