"""Scored eviction: the store under every evict-by-score policy (StreamingLLM, SnapKV, ... ; H2O or TOVA would
be one more ``score``).

A :class:`ScoredStore` keeps at most ``budget`` slots per (row, KV head): the first ``sink`` real tokens of the
row and its ``window`` most recent tokens are protected, the other slots compete by ``score()`` (higher = kept).
Eviction runs right after the prefill and then in bulk, at the start of ``update``, once ``tail`` tokens above
the budget have accumulated; so a layer holds at most ``budget + tail`` slots and ``crop`` of the tokens added
since the last eviction is exact (the crop floor is the last eviction point). ``reserve(n)`` evicts early so
that a speculative round of ``n`` tokens never evicts in its middle.

Scores may depend on queries: with ``observe > 0`` the store keeps the last ``observe`` queries it has seen
(``obs [B, Hq, w, D]``, the prefill's last queries, then decode queries; cropped with their tokens), and
:func:`window_attention` / :func:`pool_group` compute the observation-window attention the SnapKV/CAKE family
scores with, without ever materialising an ``S x S`` matrix.

Eviction is per KV head when ``score()`` returns ``[B, H, n]`` (positions then become ``[B, H, n]``), or the
same for all heads when it returns ``[B, 1, n]``. Padding slots (position -1) are always evicted first, and a
left-padded row keeps exactly what it keeps alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvkit.stores.base import LayerInfo, SlotStore
from kvkit.stores.buffers import ring_last, ring_write
from kvkit.stores.layer import tensor_bytes


def window_attention(q_obs, keys, pos, qpos, scaling) -> torch.Tensor:
    """``softmax(q_obs K^T * scaling)`` in fp32 over held slots, causal by position.

    q_obs ``[B, Hq, w, D]``; keys ``[B, H, n, D]``; pos ``[B, Hp, n]`` (-1 = padding); qpos ``[w]``.
    Returns ``[B, Hq, w, n]`` (rows that see nothing are zeros).
    """
    B, Hq, w, D = q_obs.shape
    H, n = keys.shape[1], keys.shape[2]
    s = torch.einsum("bhgwd,bhnd->bhgwn", q_obs.float().view(B, H, Hq // H, w, D), keys.float()) * scaling
    p = pos[:, :, None, None, :]
    allowed = (p <= qpos.view(1, 1, 1, w, 1)) & (p >= 0)
    a = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.nan_to_num(a, nan=0.0).view(B, Hq, w, n)


#: where the pooling window of a token lies: ``centered`` (the SnapKV / CAKE references: ``kernel // 2`` slots on
#: each side) or ``trailing`` (kvkit: the token and the ``kernel - 1`` slots before it, so the tokens that follow an
#: attended one -- a needle's value after its key -- inherit its score; twice the forward reach of the same kernel)
POOL_WINDOWS = ("centered", "trailing")


def pool_group(x: torch.Tensor, kernel: int, num_kv_heads: int, mode: str = "avg",
               window: str = "centered") -> torch.Tensor:
    """``x [B, Hq, m]`` pooled along keys (``kernel``, stride 1, same length; ``window`` of :data:`POOL_WINDOWS`;
    zeros beyond the ends, counted by the average) and averaged over each KV head's query group: ``[B, H, m]``."""
    B, Hq, m = x.shape
    if m > 0 and kernel > 1:
        pool = F.avg_pool1d if mode == "avg" else F.max_pool1d
        if window == "trailing":
            x = pool(F.pad(x, (kernel - 1, 0)), kernel_size=kernel, stride=1)
        else:
            x = pool(x, kernel_size=kernel, padding=kernel // 2, stride=1)
    return x.view(B, num_kv_heads, Hq // num_kv_heads, m).mean(dim=2)


class ScoredStore(SlotStore):
    """Sinks + recent window protected, the rest kept by ``score()``; bulk eviction every ``tail`` tokens."""

    _batch_tensors = SlotStore._batch_tensors + ("obs",)

    def __init__(self, info: LayerInfo, budget: int, sink: int, window: int, tail: int, observe: int = 0,
                 num_heads: int | None = None):
        super().__init__(info, num_heads)
        if sink + window > budget:
            raise ValueError(f"sink ({sink}) + window ({window}) must not exceed the budget ({budget})")
        self.budget, self.sink, self.window, self.tail, self.observe = budget, sink, window, tail, observe
        self.obs: torch.Tensor | None = None  # [B, Hq, <= observe, D] the last queries seen
        self.obs_pos: torch.Tensor | None = None  # static: [observe + obs_extra] the ring's positions
        self.scaling = info.head_dim**-0.5

    # ---- the policy hook ------------------------------------------------------------------------------
    def score(self) -> torch.Tensor:
        """``[B, 1|H, n]`` keep-priority of the held slots (higher = kept). Default: recency."""
        return self.pos.float()

    # ---- eviction -------------------------------------------------------------------------------------
    def protected(self) -> torch.Tensor:
        """``[B, Hp, n]`` slots never evicted: the row's first ``sink`` real tokens and its ``window`` newest."""
        recent = self.pos >= self.seen - min(self.window, self.seen)  # python ints: no int32 overflow
        return (self.sinks() | recent) & (self.pos >= 0)

    def sinks(self) -> torch.Tensor:
        """``[B, Hp, n]`` the row's first ``sink`` real tokens (counted from its first non-padding position)."""
        first = self.first_pos.view(-1, 1, 1)
        return (self.pos >= first) & (self.pos < first + self.sink)

    def should_compress(self) -> bool:
        return self.keys.shape[-2] >= self.budget + self.tail

    def slots_bound(self) -> int:
        return self.budget + self.tail

    def compress(self) -> None:
        if self.keys.shape[-2] <= self.budget:
            return
        self.evict_by_score(self.priority(), self.budget)

    def priority(self) -> torch.Tensor:
        """``[B, 1|H, n]`` the eviction order: ``score()`` with protected slots ``+inf`` and padding ``-inf``."""
        score = self.score().float()
        prot = self.protected()
        if prot.shape[1] != score.shape[1]:
            prot = prot.expand(-1, max(prot.shape[1], score.shape[1]), -1)
            score = score.expand_as(prot)
        return score.masked_fill(prot, float("inf")).masked_fill(self.pos.expand_as(score) < 0, float("-inf"))

    def reserve(self, n: int) -> None:
        if self.keys is not None and self.keys.shape[-2] + n >= self.budget + self.tail:
            self.compress()
            self.committed = self.seen

    def on_prefill(self, query, module) -> None:
        self.compress()

    # ---- observed queries -----------------------------------------------------------------------------
    #: queries kept past ``observe`` so that a rollback still leaves ``observe`` of them
    obs_extra = 64

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        self.scaling = scaling
        self.record_queries(query)  # before attend: the prefill's eviction scores with these queries
        return super().attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    def record_queries(self, query: torch.Tensor) -> None:
        """Keep the last ``observe + obs_extra`` queries: ``obs [B, Hq, w, D]`` in order; in a static store a ring
        ``obs [B, Hq, observe + obs_extra, D]`` written at slot ``position % size``, with ``obs_pos [size]`` the
        position each slot holds (-1: none), so a compiled step writes it in place."""
        if not self.observe:
            return
        if not self.static:
            q = query.detach()[:, :, -self.observe :]
            self.obs = q if self.obs is None else torch.cat([self.obs, q], dim=2)[:, :, -(self.observe + self.obs_extra) :]
            return
        T = query.shape[2]  # positions seen_t - T .. seen_t - 1 (update ran first)
        self.obs, self.obs_pos = ring_write(self.obs, self.obs_pos, query.detach(), self.seen_t - T,
                                            self.observe + self.obs_extra)

    def observed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``observe`` queries ``[B, Hq, w, D]`` and their positions ``[w]`` (in position order)."""
        if self.static:
            return ring_last(self.obs, self.obs_pos, self.observe, self.seen)
        q = self.obs[:, :, -self.observe :]
        w = q.shape[2]
        return q, torch.arange(self.seen - w, self.seen, device=q.device, dtype=torch.int32)

    def _drop_last(self, n: int) -> None:
        super()._drop_last(n)
        if self.obs is not None and self.static:
            self.obs_pos.masked_fill_(self.obs_pos >= self.seen - n, -1)
        elif self.obs is not None:
            self.obs = self.obs[:, :, : max(self.obs.shape[2] - n, 0)]

    def keep_slots(self, idx: torch.Tensor) -> None:
        if idx.shape[1] > 1 and self.pos.shape[1] == 1:  # per-head eviction: positions become per head
            self.pos = self.pos.expand(-1, idx.shape[1], -1).contiguous()
        super().keep_slots(idx)

    def reset(self) -> None:
        super().reset()
        self.obs = self.obs_pos = None

    def nbytes(self) -> int:
        return super().nbytes() + tensor_bytes(self.obs)

    def read_nbytes(self) -> int:
        """What a decode step's attention reads: the held K/V and their positions (the observed queries are
        scoring state, read only by an eviction)."""
        return SlotStore.nbytes(self)
