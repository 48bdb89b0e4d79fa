"""``zipcache``: ZipCache (He et al., arXiv:2405.14256) -- saliency-driven mixed-precision KV quantisation.

Prefill: probe queries (the last 5% of the prompt plus 5% random earlier positions, fixed seed) score
every prompt token: ``softmax(q K^T / sqrt(d) + causal mask)`` in fp32, summed over the query heads of
a KV group and over the probes, divided by the number of probes that can see the token (the
paper's normalisation by visibility, which removes the bias towards early tokens). Per (row, KV
head) the ``high_ratio`` most salient tokens are stored at ``high_bits``, the rest at ``low_bits``:

* keys (post-RoPE): asymmetric, one min/scale per channel over the tokens of each precision group;
* values: channel pre-scale ``c = sqrt(max |V|)`` per channel, ``V / c`` quantised per token
  (asymmetric), per precision group;
* codes packed into uint8 (two 4-bit / four 2-bit values per byte) by ``kvkit.kernels.quantize``.

Tokens are stored *grouped by precision* (one :class:`~kvkit.kernels.Packed` per group), so no
per-token precision flag is needed: the per-token metadata is the group's slot order itself, and a
row's valid length per group (``[B]`` int64) masks the rectangular padding. Nothing is kept in
full precision except the tail of new tokens: decode attends straight from the packed groups with
``kvkit.kernels.quant_decode`` (Triton on CUDA; on CPU its torch reference dequantizes on the fly
per call, never into the store) and merges them with the tail through their log-sum-exp.

Decode: new tokens stay full precision; their saliency accumulates from the attention the decoding
queries pay them (divided by how many queries saw each token). Every ``requant_interval`` new
tokens, at the start of ``update`` (so ``crop`` of the tail stays exact), the tail is quantised into
a new segment with fresh statistics and the same high/low split. A store therefore holds one
segment for the prompt plus one per ``requant_interval`` decoded tokens.

Bytes per token and KV head (D = head_dim, s = bytes of a statistic: 2 for fp16/bf16 models, 4 for
fp32): ``2 * D * bits / 8`` of codes + ``2 * s`` value scale/zero; per group and head ``2 * D * s``
key statistics + ``D * 4`` value pre-scale. Default 60% 4-bit / 40% 2-bit at D = 64, fp16:
``2 * 64 * 3.2 / 8 + 4 = 55.2`` bytes vs 256 -> 4.6x fewer than fp16 (8.6x fewer than fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvkit.kernels import Packed, merge_attn, packed_nbytes, quant_decode, quantize
from kvkit.policies.base import Policy, check_fraction, check_positive_int
from kvkit.registry import register
from kvkit.stores import LayerInfo, SlotStore
from kvkit.stores import tensor_bytes as _tensor_bytes

BITS = (2, 4, 8)


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
    probe_ratio : float
        Probe queries: the last ``probe_ratio`` of the prompt plus as many random earlier positions
        (5% + 5% in the paper).
    requant_interval : int
        New tokens kept in full precision before they are quantised (100 in the paper).
    seed : int
        Seed of the random probe positions.
    probe_chunk : int
        Probe queries scored at once (bounds the prefill scoring memory; kvkit, not the paper).
    """

    high_ratio: float = 0.6  # ZipCache: 60% salient tokens at 4 bits, 40% at 2 bits
    high_bits: int = 4  # ZipCache Table 2 setting
    low_bits: int = 2  # ZipCache Table 2 setting
    probe_ratio: float = 0.05  # ZipCache: 5% recent + 5% random probe tokens
    requant_interval: int = 100  # ZipCache: streaming re-quantisation every 100 decoded tokens
    seed: int = 0
    probe_chunk: int = 256

    description = "ZipCache: saliency (probe-query attention) picks 4-bit vs 2-bit tokens, packed KV (2405.14256)"
    saves = "memory+reads"  # decode reads the packed codes (Triton quant_decode on CUDA)

    def __post_init__(self):
        for name in ("high_bits", "low_bits"):
            b = getattr(self, name)
            if isinstance(b, bool) or b not in BITS:
                raise ValueError(f"zipcache: {name} must be one of {BITS} (bits per value), got {b!r}")
        if self.low_bits > self.high_bits:
            raise ValueError(
                f"zipcache: low_bits ({self.low_bits}) must not exceed high_bits ({self.high_bits}); "
                "salient tokens get the higher precision"
            )
        check_fraction("zipcache", "high_ratio", self.high_ratio, low_open=False)
        check_fraction("zipcache", "probe_ratio", self.probe_ratio, high_closed=False)
        check_positive_int("zipcache", "requant_interval", self.requant_interval)
        check_positive_int("zipcache", "probe_chunk", self.probe_chunk)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"zipcache: seed must be an integer, got {self.seed!r}")

    def validate(self, config) -> None:
        heads = config.num_attention_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // heads
        if d % 4:
            raise ValueError(f"zipcache: head_dim {d} must be a multiple of 4 to pack 2-bit values into bytes")

    def new_layer(self, info: LayerInfo):
        return ZipCacheStore(info, self)


@dataclass
class Segment:
    """One quantised block of tokens: a high- and a low-precision group (either may be absent)."""

    parts: list  # [(kpack: Packed, vpack: Packed, length: LongTensor [B])]

    def tokens(self) -> int:
        return sum(int(n.max()) for _, _, n in self.parts)


def _map_packed(p: Packed, fn) -> Packed:
    pre = None if p.prescale is None else fn(p.prescale)
    data = fn(p.data)
    return replace(p, data=data, scale=fn(p.scale), zero=fn(p.zero), prescale=pre,
                   shape=(data.shape[0], *p.shape[1:]))


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


class ZipCacheStore(SlotStore):
    """Packed mixed-precision segments + a full-precision tail (the SlotStore's keys/values)."""

    def __init__(self, info: LayerInfo, policy: ZipCache):
        super().__init__(info)
        self.p = policy
        self.segments: list[Segment] = []
        self.sal_sum: torch.Tensor | None = None  # [B, H, n_tail] fp32 attention mass on tail tokens
        self.sal_cnt: torch.Tensor | None = None  # [B, 1, n_tail] fp32 queries that could see them

    # ---- bookkeeping -------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.segments = []
        self.sal_sum = self.sal_cnt = None

    def append(self, k, v) -> None:
        super().append(k, v)
        B, H, T, _ = k.shape
        z = torch.zeros(B, H, T, dtype=torch.float32, device=k.device)
        zc = torch.zeros(B, 1, T, dtype=torch.float32, device=k.device)
        self.sal_sum = z if self.sal_sum is None else torch.cat([self.sal_sum, z], -1)
        self.sal_cnt = zc if self.sal_cnt is None else torch.cat([self.sal_cnt, zc], -1)

    def _drop_last(self, n: int) -> None:
        super()._drop_last(n)
        self.sal_sum, self.sal_cnt = self.sal_sum[..., :-n], self.sal_cnt[..., :-n]

    def _apply_batch(self, fn) -> None:
        super()._apply_batch(fn)
        self.sal_sum = None if self.sal_sum is None else fn(self.sal_sum)
        self.sal_cnt = None if self.sal_cnt is None else fn(self.sal_cnt)
        for seg in self.segments:
            seg.parts = [(_map_packed(k, fn), _map_packed(v, fn), fn(n)) for k, v, n in seg.parts]

    def nbytes(self) -> int:
        n = _tensor_bytes(self.keys, self.values, self.pos, self.sal_sum, self.sal_cnt, self.first_pos)
        for seg in self.segments:
            for k, v, length in seg.parts:
                n += packed_nbytes(k) + packed_nbytes(v) + _tensor_bytes(length)
        return n

    def num_slots(self) -> int:
        tail = 0 if self.keys is None else self.keys.shape[-2]
        return tail + sum(seg.tokens() for seg in self.segments)

    def quantized_tokens(self) -> int:
        return sum(seg.tokens() for seg in self.segments)

    # ---- quantisation ------------------------------------------------------------------------
    def _quantize_block(self, k, v, valid, sal) -> Segment:
        """k, v ``[B, H, n, D]``; valid ``[B, n]`` bool; sal ``[B, H, n]`` -> a two-group Segment."""
        B, H, n, D = k.shape
        n_real = valid.sum(-1)  # [B]
        hi = torch.ceil(n_real.double() * self.p.high_ratio - 1e-9).long().clamp(max=n_real)
        hi = torch.minimum(hi, n_real)
        lo = n_real - hi
        sal = sal.float().masked_fill(~valid[:, None, :], float("-inf"))
        order = sal.argsort(dim=-1, descending=True, stable=True)  # [B, H, n]: salient first, padding last
        parts = []
        for start, count, bits in ((torch.zeros_like(hi), hi, self.p.high_bits), (hi, lo, self.p.low_bits)):
            m = int(count.max()) if count.numel() else 0
            if m == 0:
                continue
            j = torch.arange(m, device=k.device)
            src = (start[:, None] + j).clamp(max=n - 1)  # [B, m]
            first = start.clamp(max=n - 1)[:, None].expand(B, m)
            # rectangular padding duplicates the group's first token: min/max statistics are unchanged
            src = torch.where(j[None] < count[:, None], src, first)
            idx = order.gather(-1, src[:, None, :].expand(B, H, m))  # [B, H, m]
            gi = idx[..., None].expand(B, H, m, D)
            kg, vg = k.gather(2, gi), v.gather(2, gi)
            kp = quantize(kg, bits, None, axis=-2)  # per channel over the group's tokens
            vp = quantize(vg, bits, None, axis=-1, channel_prescale=True)  # per token of V / sqrt(max|V|)
            parts.append((kp, vp, count.clone()))
        return Segment(parts)

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

    def _quantize_tail(self, sal) -> None:
        valid = self.pos[:, 0] >= 0
        self.segments.append(self._quantize_block(self.keys, self.values, valid, sal))
        B, H, _, D = self.keys.shape
        self.keys = self.keys[..., :0, :]
        self.values = self.values[..., :0, :]
        self.pos = self.pos[..., :0]
        self.sal_sum, self.sal_cnt = self.sal_sum[..., :0], self.sal_cnt[..., :0]

    # ---- policy hooks ------------------------------------------------------------------------
    def on_prefill(self, query, module) -> None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        self._quantize_tail(self._saliency_prefill(query, scaling))

    def should_compress(self) -> bool:
        return self.keys.shape[-2] >= self.p.requant_interval

    def compress(self) -> None:
        # fresh statistics; saliency of the new tokens from the decoding queries' attention
        self._quantize_tail(self.sal_sum / self.sal_cnt.clamp(min=1))

    def decode(self, query, qpos, scaling):
        B, Hq, T, D = query.shape
        out = lse = None
        for seg in self.segments:
            for kp, vp, length in seg.parts:
                o, s = quant_decode(query, kp, vp, scale=scaling, valid=length, return_lse=True)
                out, lse = (o, s) if out is None else merge_attn(out, lse, o, s)
        n = self.keys.shape[-2]
        if n:
            H = self.keys.shape[1]
            G = Hq // H
            q = query.float().reshape(B, H, G * T, D)
            s = torch.matmul(q, self.keys.float().transpose(-1, -2)) * scaling  # [B, H, G*T, n]
            pos = self.pos[:, 0]  # [B, n]
            see = (pos[:, None, :] <= qpos.view(1, T, 1)) & (pos[:, None, :] >= 0)  # [B, T, n]
            see_g = see[:, None, None].expand(B, H, G, T, n).reshape(B, H, G * T, n)
            s = s.masked_fill(~see_g, float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.exp(s - m)
            tot = e.sum(-1, keepdim=True)
            o = torch.matmul(e / tot.clamp(min=1e-30), self.values.float())  # [B, H, G*T, D]
            s_lse = (torch.log(tot) + m).squeeze(-1)  # [B, H, G*T]
            o = o.view(B, Hq, T, D).to(query.dtype)
            s_lse = s_lse.view(B, Hq, T)
            out, lse = (o, s_lse) if out is None else merge_attn(out, lse, o, s_lse)
            # saliency of tail tokens: their share of each query's full attention, summed over the group
            lse_g = lse.view(B, H, G * T, 1).float()
            prob = torch.exp(s - lse_g).nan_to_num(0.0)
            self.sal_sum = self.sal_sum + prob.sum(2)
            self.sal_cnt = self.sal_cnt + see.float().sum(1, keepdim=True)
        if out is None:
            return torch.zeros(B, T, Hq, D, dtype=query.dtype, device=query.device)
        if T > 1:
            out = torch.nan_to_num(out, nan=0.0)
        return out.transpose(1, 2)
