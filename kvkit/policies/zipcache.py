"""``zipcache``: ZipCache (He et al., arXiv:2405.14256) -- saliency-driven mixed-precision KV quantisation.

This file holds only ZipCache's choices; the packed segments, the full-precision tail, the decode read and
the LSE merge are :class:`kvkit.stores.quantized.QuantizedSegmentStore`.

Saliency at prefill: probe queries (the last 5% of the prompt plus 5% random earlier positions, fixed seed)
score every prompt token: ``softmax(q K^T / sqrt(d) + causal mask)`` in fp32, summed over the query heads of
a KV group and over the probes, divided by the number of probes that can see the token (the paper's
normalisation by visibility, which removes the bias towards early tokens).

Bit split: per (row, KV head) the ``high_ratio`` most salient tokens get ``high_bits``, the rest
``low_bits`` (two groups, one packed part each). Keys (post-RoPE) are quantised per channel over each group's
tokens; values are divided by a per-channel pre-scale ``c = sqrt(max |V|)`` and quantised per token.
``key_bits`` (not in the paper) stores every key at one width while the values keep the saliency split.

Decode saliency: new tokens stay full precision; each decoding query adds its attention probability (over
everything held) to the tail tokens it sees, summed over the group's query heads; divided by how many
queries saw each token. Every ``requant_interval`` new tokens, at the start of ``update`` (so ``crop`` of the
tail stays exact), the tail becomes a new segment with fresh statistics and the same split.

Bytes per token and KV head (D = head_dim, s = bytes of a statistic: 2 for fp16/bf16 models, 4 for fp32):
``D * (key bits + value bits) / 8`` of codes + ``2 * s`` value scale/zero; per group and head ``2 * D * s``
key statistics + ``D * 4`` value pre-scale + an int64 length; plus the tail and its fp32 saliency sums.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvkit.calibration import resolve
from kvkit.policies.base import Policy, check_fraction, check_positive_int
from kvkit.policies.knobs import unreachable
from kvkit.registry import register
from kvkit.stores import LayerInfo, QuantizedSegmentStore
from kvkit.stores import tensor_bytes as _tensor_bytes
from kvkit.stores.quantized import rank_groups
from kvkit.stores.static import static_store

BITS = (2, 4, 8)


def check_bits(name: str, b, allow_none: bool = False) -> None:
    """A bit width option: an ``int`` of :data:`BITS` (None too with ``allow_none``); a float such as ``8.0`` (from
    JSON, a calibration file) is refused by name, since the packing kernels index by it."""
    if b is None and allow_none:
        return
    if isinstance(b, bool) or not isinstance(b, int) or b not in BITS:
        kind = f" (a {type(b).__name__}; write it as an integer)" if isinstance(b, float) and b in BITS else ""
        none = "None or " if allow_none else ""
        raise ValueError(f"zipcache: {name} must be {none}an integer of {BITS} (bits per value), got {b!r}{kind}")


@register("zipcache")
@dataclass(frozen=True)
class ZipCache(Policy):
    """ZipCache mixed-precision quantised KV.

    Parameters
    ----------
    high_ratio : float
        Fraction of tokens per (row, KV head) kept at ``high_bits`` (0.6: the paper's 60% / 40% split).
    high_bits, low_bits : int
        Bit widths of the salient / other tokens (4 / 2 in the paper); each one of 2, 4, 8.
    key_bits : int or None
        One bit width for every key (2, 4 or 8) while the values keep the ``high_bits`` / ``low_bits``
        split; None (default, the paper): keys follow the split too.
    key_group : int or None
        Tokens per key statistic: keys are quantised per channel with one min/scale per ``key_group`` tokens of a
        part (KIVI-style groups: smaller groups lower the key quantisation error, at 2 x D x s bytes per group
        and KV head; the two layouts compared on fresh needles: results/needles/README.md). Default 32
        (kvkit); None (the paper): one statistic per channel over the whole part.
    stats : str
        dtype of the quantisation scales and zero points: ``"float16"`` (default, kvkit: half the statistics'
        bytes of an fp32 model; a block beyond fp16's range keeps fp32), ``"float32"``, or ``"auto"`` (the paper's
        setting here: fp16 for 16-bit models, fp32 otherwise). The paper's setting is
        ``key_group=None, stats="auto", calibrated=False``.
    probe_ratio : float
        Probe queries: the last ``probe_ratio`` of the prompt plus as many random earlier positions
        (5% + 5% in the paper).
    requant_interval : int
        New tokens kept in full precision before they are quantised (100 in the paper).
    seed : int
        Seed of the random probe positions.
    probe_chunk : int
        Probe queries scored at once (bounds the prefill scoring memory; kvkit, not the paper).
    calibrated : bool
        True (default): when ``high_ratio``, ``high_bits``, ``low_bits`` and ``key_bits`` are all left at
        their defaults, the model's calibrated widths are used if one is found from its config
        (``kvkit calibrate zipcache``: the fewest bytes that keep calibration needles; shipped for the
        bundled models, :mod:`kvkit.calibration`). False: the paper's 60% 4-bit / 40% 2-bit split.
    """

    high_ratio: float = 0.6  # ZipCache: 60% salient tokens at 4 bits, 40% at 2 bits
    high_bits: int = 4  # ZipCache Table 2 setting
    low_bits: int = 2  # ZipCache Table 2 setting
    key_bits: int | None = None  # kvkit: keys at one width (None: the paper's split for keys too)
    key_group: int | None = 32  # kvkit: tokens per key statistic (None: the paper, one per channel per part)
    stats: str = "float16"  # kvkit: dtype of scales / zero points ("auto": the model's 16-bit dtype, else fp32)
    probe_ratio: float = 0.05  # ZipCache: 5% recent + 5% random probe tokens
    requant_interval: int = 100  # ZipCache: streaming re-quantisation every 100 decoded tokens
    seed: int = 0  # any fixed seed: the random probes, and so the bit split, are reproducible
    probe_chunk: int = 256  # kvkit: bounds the prefill scoring memory, not the result
    calibrated: bool = True  # kvkit: the model's calibrated bit widths when none given; False = paper's 4/2 split

    description = "ZipCache: saliency (probe-query attention) picks 4-bit vs 2-bit tokens, packed KV (2405.14256)"
    saves = "memory+reads"  # decode reads the packed codes (Triton quant_decode on CUDA)
    static_capable: ClassVar[bool] = True
    calibrated_options: ClassVar[tuple[str, ...]] = ("high_ratio", "high_bits", "low_bits", "key_bits")
    ratio_knobs: ClassVar[tuple[str, ...]] = ("high_ratio", "high_bits", "low_bits", "key_bits")
    ratio_needs_length: ClassVar[bool] = False  # bit widths from the element size: a static cache needs no prompt
    #: the paper: one key statistic per channel per part, the model's 16-bit statistics, the 60% 4-bit / 40% 2-bit split
    paper: ClassVar[dict] = dict(key_group=None, stats="auto", calibrated=False)
    covering_options: ClassVar[dict | None] = None
    speculative_refusal: ClassVar[str | None] = (
        "ZipCache re-quantises every requant_interval tokens with saliencies from the current queries; a "
            "speculative round feeds gamma + 1 tokens at once and must keep them croppable, so the "
            "re-quantisation runs at another token count than in one-token decoding"
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("high_bits", "low_bits", "key_bits"):
            check_bits(name, getattr(self, name), allow_none=name == "key_bits")
        if self.low_bits > self.high_bits:
            raise ValueError(
                f"zipcache: low_bits ({self.low_bits}) must not exceed high_bits ({self.high_bits}); "
                "salient tokens get the higher precision"
            )
        if self.key_group is not None:
            check_positive_int("zipcache", "key_group", self.key_group)
        if self.stats not in ("float16", "float32", "auto"):
            raise ValueError(f"zipcache: stats must be 'float16', 'float32' or 'auto', got {self.stats!r}")
        check_fraction("zipcache", "high_ratio", self.high_ratio, low_open=False)
        check_fraction("zipcache", "probe_ratio", self.probe_ratio, high_closed=False)
        check_positive_int("zipcache", "requant_interval", self.requant_interval)
        check_positive_int("zipcache", "probe_chunk", self.probe_chunk)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"zipcache: seed must be an integer, got {self.seed!r}")

    def uses_calibration(self) -> bool:
        return self.compression_ratio is None  # the calibrated options are the bit widths the ratio sets

    def validate(self, config) -> None:
        heads = config.num_attention_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // heads
        if d % 4:
            raise ValueError(f"zipcache: head_dim {d} must be a multiple of 4 to pack 2-bit values into bytes")

        resolve(self, config)  # a malformed calibration file for this model is refused at patch time

        if self.compression_ratio is not None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            e = torch.empty(0, dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4
            self.bits_for(e, d)

    def bits_for(self, element_size: int, head_dim: int) -> ZipCache:
        """This policy with ``compression_ratio`` as bit widths for a model of ``element_size`` bytes per value:
        per token and KV head a ``(key bits + value bits) / (16 x element_size)`` share of full's bytes in codes,
        plus the statistics' ``o`` (value scale and zero point per token, key scale and zero point per channel per
        ``key_group`` tokens); ``high_ratio`` of the tokens at the wider of two adjacent widths (2/4 or 4/8):
        ``h 2 high + (1 - h) 2 low = 16 e (1 - r - o)``. Raises ValueError (the reachable range) beyond 2 or 8 bits."""
        e, D, r = element_size, head_dim, self.compression_ratio
        s = {"float16": 2, "float32": 4}.get(self.stats, 2 if e == 2 else 4)
        o = (2 * s + (2 * D * s / self.key_group if self.key_group else 0)) / (2 * D * e)
        bits = (16 * e) * (1 - r - o)  # key + value bits per token on average
        lo, hi = 2 * BITS[0], 2 * BITS[-1]
        if not lo <= bits <= hi:
            raise unreachable("zipcache", r, 1 - hi / (16 * e) - o, 1 - lo / (16 * e) - o,
                              f"{BITS[0]} to {BITS[-1]} bits per value of a {8 * e}-bit model, with its statistics")
        low, high = (2, 4) if bits <= 8 else (4, 8)
        h = (bits - 2 * low) / (2 * (high - low))
        return dataclasses.replace(self, compression_ratio=None, high_ratio=min(max(h, 0.0), 1.0), high_bits=high,
                                   low_bits=low, key_bits=None, calibrated=False)

    def new_layer(self, info: LayerInfo):
        cls = static_store(ZipCacheStore) if info.static else ZipCacheStore  # the ratio needs no prompt length
        return cls(info, resolve(self, info.config))


def probe_positions(n_real: int, ratio: float, seed: int) -> torch.Tensor:
    """Probe query positions (relative to the first real token) for a prompt of ``n_real`` tokens."""
    n_recent = max(1, math.ceil(ratio * n_real))
    recent = torch.arange(n_real - n_recent, n_real)
    earlier = n_real - n_recent
    n_rand = min(earlier, int(ratio * n_real))
    if n_rand == 0:
        return recent
    g = torch.Generator().manual_seed(seed)
    rand = torch.randperm(earlier, generator=g)[:n_rand].sort().values
    return torch.cat([rand, recent])


@dataclass
class SaliencyUndo:
    """What a multi-token forward (a speculative verification) added to the tail's saliency, kept until the next
    forward so that a rollback of its tokens removes their queries' attention from the sums exactly.

    ``start``: the position of its first token; ``sal_sum [B, H, n]`` / ``sal_cnt [B, 1, n]``: the sums before it
    observed (``n`` tail slots, its own tokens included at 0); ``per_query``: inside a verification, each query's
    contribution ``([B, H, T, n] attention mass, [B, T, n] visibility)`` (small: ``T`` is the drafts + 1), so a
    rollback keeping its first queries keeps theirs; None otherwise (a long chunk: only the whole forward is undone
    exactly; a rollback keeping part of it keeps the sums as they are)."""

    start: int
    sal_sum: torch.Tensor
    sal_cnt: torch.Tensor
    per_query: tuple | None

    def restore(self, seen_after: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sums ``(sal_sum, sal_cnt)`` (the ``n`` slots; the caller truncates) once the tokens from position
        ``seen_after`` on are rolled back: those of the forward's first ``seen_after - start`` queries only."""
        kept = seen_after - self.start
        if kept <= 0:
            return self.sal_sum, self.sal_cnt
        if self.per_query is None:
            return None
        mass, see = self.per_query
        return self.sal_sum + mass[:, :, :kept].sum(2), self.sal_cnt + see[:, :kept].sum(1, keepdim=True)


class ZipCacheStore(QuantizedSegmentStore):
    """ZipCache's saliency and bit split over the quantized-segment store.

    Static (``static_store(ZipCacheStore)``): the tail (``requant_interval`` slots) and its saliency sums
    (``sal_sum`` ``[B, H, n]``, ``sal_cnt`` ``[B, 1, n]``, 0 on a free slot as on a new token) live in static buffers,
    the decoded tokens' segments in slot segments (:mod:`kvkit.stores.quantized`); :meth:`observe` adds in place."""

    static_slot_tensors = {"sal_sum": 0.0, "sal_cnt": 0.0}

    def __init__(self, info: LayerInfo, policy: ZipCache):
        super().__init__(info, tail_tokens=policy.requant_interval, bits=policy.high_bits, value_prescale=True,
                         key_group=policy.key_group,
                         stat_dtype={"float16": torch.float16, "float32": torch.float32}.get(policy.stats))
        self.p = policy
        self.sal_sum: torch.Tensor | None = None  # [B, H, n_tail] fp32 attention mass on tail tokens
        self.sal_cnt: torch.Tensor | None = None  # [B, 1, n_tail] fp32 queries that could see them
        #: the newest multi-token forward's saliency before it observed, for an exact rollback (:meth:`_drop_last`)
        self.undo: SaliencyUndo | None = None
        self.verifying = False  # inside a speculative verification: its per-query contributions are kept too

    def set_verifying(self, on: bool) -> None:
        self.verifying = on

    # ---- per-tail-token saliency accumulators (follow the tail through append / crop / batch ops) --------
    def reset(self) -> None:
        super().reset()
        self.sal_sum = self.sal_cnt = self.undo = None

    def appended(self, T: int) -> None:
        super().appended(T)
        self.undo = None  # a new forward: the record of the previous one no longer describes the newest tokens

    def append(self, k, v) -> None:
        super().append(k, v)
        B, H, T, _ = k.shape
        z = torch.zeros(B, H, T, dtype=torch.float32, device=k.device)
        zc = torch.zeros(B, 1, T, dtype=torch.float32, device=k.device)
        self.sal_sum = z if self.sal_sum is None else torch.cat([self.sal_sum, z], -1)
        self.sal_cnt = zc if self.sal_cnt is None else torch.cat([self.sal_cnt, zc], -1)

    def _drop_last(self, n: int) -> None:
        """Drop the newest ``n`` tail tokens and the saliency their queries added (:class:`SaliencyUndo`): after a
        rollback of a multi-token forward's tokens the tail's sums are those of a cache that never saw them."""
        keep = self.sal_sum.shape[-1] - n
        sums = self.undo.restore(self.seen - n) if self.undo is not None else None
        s, c = sums if sums is not None else (self.sal_sum, self.sal_cnt)
        super()._drop_last(n)
        self.sal_sum, self.sal_cnt = s[..., :keep], c[..., :keep]

    def _apply_batch(self, fn) -> None:
        self.undo = None
        super()._apply_batch(fn)
        self.sal_sum = None if self.sal_sum is None else fn(self.sal_sum)
        self.sal_cnt = None if self.sal_cnt is None else fn(self.sal_cnt)

    def nbytes(self) -> int:
        return super().nbytes() + _tensor_bytes(self.sal_sum, self.sal_cnt)

    def compress_tail(self, score=None) -> None:
        super().compress_tail(score)
        if self.sal_sum is not None:
            self.sal_sum, self.sal_cnt = self.sal_sum[..., :0], self.sal_cnt[..., :0]

    def slots_bound(self) -> int:
        """The tail never holds more than ``requant_interval`` tokens between compressions."""
        return self.tail_tokens

    # ---- ZipCache's choices --------------------------------------------------------------------------
    def split_block(self, k, v, valid, score):
        """The ``high_ratio`` most salient tokens at ``high_bits``, the rest at ``low_bits`` (keys: ``key_bits``
        when set)."""
        kb = self.p.key_bits
        bits = ((kb or self.p.high_bits, self.p.high_bits), (kb or self.p.low_bits, self.p.low_bits))
        return rank_groups(score, valid, (self.p.high_ratio,), bits)

    def tail_score(self):
        """Decode saliency of the tail: attention mass / queries that saw each token."""
        return self.sal_sum / self.sal_cnt.clamp(min=1)

    def on_prefill(self, query, module) -> None:
        if self.p.compression_ratio is not None:  # the bit widths for the model's element size
            self.p = self.p.bits_for(self.keys.element_size(), self.keys.shape[-1])
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        self.compress_tail(self._saliency_prefill(query, scaling))
        self.reserve_segments()

    def observe(self, query, qpos, scaling, lse) -> None:
        """Add each tail token's share of every query's attention (over everything held) to its saliency."""
        n = self.keys.shape[-2]
        if not n:
            return
        B, Hq, T, D = query.shape
        H = self.keys.shape[1]
        G = Hq // H
        q = query.to(self.keys.dtype).reshape(B, H, G * T, D)
        # q K^T in the cache's dtype as eager attention computes it (no fp32 copy of the tail), then fp32
        s = torch.matmul(q, self.keys.transpose(-1, -2)).float().mul_(scaling)  # [B, H, G*T, n]
        prob = s.sub_(lse.view(B, H, G * T, 1).float()).exp_()
        pos = self.pos[:, 0]  # [B, n]
        # in place: a static store's sums are its buffers (a compiled step cannot reassign them)
        if self.dense_decode(T):  # one query per row that sees every tail token
            self.sal_sum.add_(prob.sum(2))
            self.sal_cnt.add_(1.0)
            return
        see = (pos[:, None, :] <= qpos.view(1, T, 1)) & (pos[:, None, :] >= 0)  # [B, T, n]
        see_g = see[:, None, None].expand(B, H, G, T, n).reshape(B, H, G * T, n)
        prob = prob.masked_fill(~see_g, 0.0).nan_to_num(0.0)
        if T > 1 and not torch.compiler.is_compiling():  # eager multi-token forward: keep what rollback restores
            per_query = (prob.view(B, H, G, T, n).sum(2), see.float()) if self.verifying else None
            self.undo = SaliencyUndo(self.seen - T, self.sal_sum.clone(), self.sal_cnt.clone(), per_query)
        self.sal_sum.add_(prob.sum(2))
        self.sal_cnt.add_(see.float().sum(1, keepdim=True))

    def _saliency_prefill(self, query, scaling) -> torch.Tensor:
        """Probe-query saliency ``[B, H, n]`` of the prompt (normalised by visibility)."""
        k = self.keys
        B, H, n, D = k.shape
        Hq = query.shape[1]
        G = Hq // H
        valid = self.pos[:, 0] >= 0  # [B, n]
        first = valid.float().argmax(-1)  # left padding: first real token
        n_real = valid.sum(-1)
        lists = [probe_positions(int(n_real[b]), self.p.probe_ratio, self.p.seed) + int(first[b]) for b in range(B)]
        P = max(len(x) for x in lists)
        probes = torch.full((B, P), -1, dtype=torch.long)
        for b, x in enumerate(lists):
            probes[b, : len(x)] = x
        probes = probes.to(k.device)
        kf = k.float()
        total = torch.zeros(B, H, n, dtype=torch.float32, device=k.device)
        cnt = torch.zeros(B, n, dtype=torch.float32, device=k.device)
        cols = torch.arange(n, device=k.device)
        for s in range(0, P, self.p.probe_chunk):
            pr = probes[:, s : s + self.p.probe_chunk]  # [B, p]
            p = pr.shape[1]
            q = query.gather(2, pr.clamp(min=0)[:, None, :, None].expand(B, Hq, p, D)).float()
            q = q.view(B, H, G * p, D)
            att = torch.matmul(q, kf.transpose(-1, -2)) * scaling  # [B, H, G*p, n]
            see = (cols[None, None, :] <= pr[:, :, None]) & valid[:, None, :] & (pr[:, :, None] >= 0)  # [B, p, n]
            see_g = see[:, None, None].expand(B, H, G, p, n).reshape(B, H, G * p, n)
            att = att.masked_fill(~see_g, float("-inf")).softmax(-1)
            att = torch.nan_to_num(att, nan=0.0)
            total += att.sum(2)
            cnt += see.float().sum(1)
        return total / cnt.clamp(min=1)[:, None, :]
