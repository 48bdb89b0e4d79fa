"""Chelsea's store (:class:`ChelseaStore`): what to merge and when, over the merge math of :mod:`kvkit.stores.merge`;
the policy, its options and the method's description are in :mod:`kvkit.policies.chelsea`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvkit.policies.knobs import slot_cost
from kvkit.stores import LayerInfo, SlotStore, attend_slots
from kvkit.stores import tensor_bytes as _tensor_bytes
from kvkit.stores.merge import (
    chunk_grid,
    compact_valid,
    merge_chunks,
    merge_keep_top,
    merge_keep_top_context,
    take_slots,
)
from kvkit.stores.reconstruct import ReconstructionScoring
from kvkit.stores.scored import pool_group, window_attention

if TYPE_CHECKING:  # annotations only: the policy (Chelsea, kvkit.policies.chelsea) is a Policy
    from kvkit.policies.base import Policy


class ChelseaStore(ReconstructionScoring, SlotStore):
    """Merged centroids (first ``n_merged`` slots) + exact slots (sinks, unmerged, window, new); each slot carries its
    cluster ``size`` ``[B, H, n]`` int32. Static (``static_store(ChelseaStore)``): keys, values, pos and size live in
    fixed-capacity buffers; merges (eager, between compiled steps) rewrite their prefix in place."""

    _batch_tensors = ("keys", "values", "pos", "first_pos", "size", "merged_upto", "score")
    static_slot_tensors = {"size": 1}  # a static variant's free slots: a new token is a cluster of one

    def __init__(self, info: LayerInfo, policy: Policy, num_heads: int | None = None, settings_at=None):
        super().__init__(info, num_heads)
        self.p = policy
        self.settings_at = settings_at  # compression_ratio: ``context -> settings`` (its ratio) at each prefill
        self.size: torch.Tensor | None = None  # [B, H, n] int32 cluster sizes
        self.merged_upto: torch.Tensor | None = None  # [B] tokens (from the first real one) already merged
        self.score: torch.Tensor | None = None  # [B, H, n] fp32 protection score (``protect`` > 0 only)
        self.n_merged = 0
        self.by_reconstruction = policy.protected_per_chunk > 0 and policy.protect_score == "reconstruct"

    def reset(self) -> None:
        super().reset()
        self.size = self.merged_upto = self.score = None
        self.n_merged = 0

    def append(self, k, v) -> None:
        B, H, T, _ = k.shape
        if self.pos is not None and self.pos.shape[1] == 1:
            self.pos = self.pos.expand(-1, H, -1).contiguous()
        super().append(k, v)
        if self.pos.shape[1] == 1:
            self.pos = self.pos.expand(-1, H, -1).contiguous()  # centroids differ per head
        one = torch.ones(B, H, T, dtype=torch.int32, device=k.device)
        self.size = one if self.size is None else torch.cat([self.size, one], -1)
        self._grow_score()

    def appended(self, T: int) -> None:
        super().appended(T)
        if self.static:  # the static variant appends without ``append`` past its first tokens (and after compiled
            self._grow_score()  # steps): its ``size`` buffer already holds 1 on the new slots

    def _grow_score(self) -> None:
        """The protection score covers every held slot: new tokens have no observation score (0); with
        ``protect_score="reconstruct"`` the reconstruction pass after the forward scores them."""
        B, H, n = self.keys.shape[:3]
        if self.score is not None and self.score.shape[2] < n:
            self.score = torch.cat([self.score, self.score.new_zeros(B, H, n - self.score.shape[2])], -1)
        elif self.score is None and self.by_reconstruction:
            self.score = torch.zeros(B, H, n, device=self.keys.device)

    def _drop_last(self, n: int) -> None:
        super()._drop_last(n)
        self.size = self.size[..., :-n]
        if self.score is not None:
            self.score = self.score[..., :-n]

    def nbytes(self) -> int:
        return _tensor_bytes(self.keys, self.values, self.pos, self.size, self.first_pos, self.merged_upto,
                             self.score)

    def read_nbytes(self) -> int:
        """What a decode step's attention reads: K/V, positions and cluster sizes (not the protection score)."""
        return _tensor_bytes(self.keys, self.values, self.pos, self.size)

    def take_scores(self) -> None:
        """The reconstruction pass is over: the slots it scored take its score as their protection score."""
        acc = self.finish_scoring()
        if acc is not None:
            self.score = torch.where(acc >= 0, acc, self.score)

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        self.last_forward_tokens = query.shape[2]
        if self.scoring:  # centroids weigh log(size) as in decoding (the repeated tokens, exact, weigh 0)
            lw = self.size.float().clamp(min=1).log() if self.p.size_bias and self.n_merged else None
            return self.scoring_attend(query, attention_mask, scaling, log_weight=lw)
        return super().attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    # ---- merging -----------------------------------------------------------------------------
    def on_prefill(self, query, module) -> None:
        if self.settings_at is not None:
            self.p = self.settings_at(self.seen, slot_cost(self.keys, extra_bytes=8))
        if self.by_reconstruction:
            return  # merging waits for the reconstruction pass (Chelsea.after_forward)
        if self.p.protected_per_chunk:
            w = max(1, min(self.p.window, query.shape[2]))
            qpos = torch.arange(self.seen - w, self.seen, device=query.device)
            scaling = getattr(module, "scaling", None) or self.info.head_dim**-0.5
            a = window_attention(query[:, :, -w:], self.keys, self.pos, qpos, scaling).sum(dim=2)  # [B, Hq, n]
            self.score = pool_group(a, self.p.protect_kernel, self.keys.shape[1], mode=self.p.protect_pooling,
                                    window=self.p.protect_window)
        self.compress()

    def should_compress(self) -> bool:
        return not self.scoring and self.p.ratio < 1 and self.seen - self.committed >= self.p.merge_interval

    def slots_bound(self) -> int | None:
        """With a ``max_length`` (a static cache's capacity in tokens): the most slots held, the centroids of every
        chunk it can hold (``ceil(max_length / chunk_size) x kept_per_chunk``) + the sinks + the recent window + a
        partial chunk + the tokens of one merge interval; None (no bound: the buffers grow) without one."""
        p, L = self.p, self.info.max_length
        if not L or p.ratio >= 1:
            return None
        return -(-L // p.chunk_size) * p.kept_per_chunk + p.sink + p.window + p.chunk_size + p.merge_interval

    def compress(self) -> None:
        """Merge each row's complete chunks between the sinks and the recent window (those not merged yet) into
        ``kept_per_chunk`` centroids each; the centroids join the merged region (the first ``n_merged`` slots)."""
        p = self.p
        if p.ratio >= 1:
            return
        B, dev = self.keys.shape[0], self.keys.device
        first = self.first_pos.long()  # [B]
        if self.merged_upto is None:
            self.merged_upto = torch.full((B,), p.sink, dtype=torch.long, device=dev)
        mu = self.merged_upto
        chunks = ((self.seen - first - p.window - mu) // p.chunk_size).clamp(min=0)  # [B] complete chunks to merge
        C = int(chunks.max()) if chunks.numel() else 0
        if C == 0:
            return
        # the exact slots (after the centroids) have the same positions on every head, position-sorted
        grid, merging, real = chunk_grid(self.pos[:, 0, self.n_merged :].long(), first, mu, chunks, C, p.chunk_size)
        merged = self._merge_grid(grid + self.n_merged, chunks)
        self._install(*merged, keep=real & ~merging)
        self.merged_upto = mu + chunks * p.chunk_size

    def _merge_grid(self, grid, chunks):
        """The slots ``grid [B, C * L]`` (C chunks of L) merged chunk by chunk, with the protection in effect:
        k, v ``[B, H, C, K, D]`` fp32, pos ``[B, H, C, K]`` (-1 in a row's chunks past ``chunks [B]``), size
        ``[B, H, C, K]`` float, ``K = kept_per_chunk``."""
        p = self.p
        B, H, _, D = self.keys.shape
        L, K, P = p.chunk_size, p.kept_per_chunk, p.protected_per_chunk
        C = grid.shape[1] // L
        gk = take_slots(self.keys, grid).float().view(B, H, C, L, D)
        gv = take_slots(self.values, grid).float().view(B, H, C, L, D)
        gp = take_slots(self.pos, grid).view(B, H, C, L)
        gs = take_slots(self.size, grid).float().view(B, H, C, L)
        if P and self.score is not None and p.protect_scope == "context":
            gsc = take_slots(self.score, grid).float().view(B, H, C, L)
            mk, mv, mp, ms = merge_keep_top_context(gk, gv, gp, gs, gsc, chunks, P, K)
        elif P and self.score is not None:
            gsc = take_slots(self.score, grid).view(B, H, C, L)
            mk, mv, mp, ms = merge_keep_top(gk, gv, gp, gs, gsc, P, K)
        else:
            mk, mv, mp, ms = merge_chunks(gk, gv, gp, gs, K)
        ok = (torch.arange(C, device=grid.device)[None, :] < chunks[:, None])[:, None, :, None]  # [B, 1, C, 1]
        return mk, mv, torch.where(ok, mp, torch.full_like(mp, -1)), ms

    def _install(self, mk, mv, mp, ms, keep) -> None:
        """New centroids ``[B, H, C, K(, D)]`` (pos -1: none) appended to the merged region, and of the exact slots
        only ``keep [B, n - n_merged]`` (sinks, partial chunk, window, new tokens) kept; padding compacted away."""
        k, v, pos, size, nm = self.keys, self.values, self.pos, self.size, self.n_merged
        B, H, C, K, D = mk.shape
        new_k = mk.to(k.dtype).reshape(B, H, C * K, D)
        new_v = mv.to(v.dtype).reshape(B, H, C * K, D)
        new_p = mp.to(pos.dtype).reshape(B, H, C * K)
        new_s = ms.round().to(torch.int32).reshape(B, H, C * K)
        # merged region: old centroids + new ones, invalid (padding) slots compacted away
        mk_all = torch.cat([k[:, :, :nm], new_k], 2)
        mv_all = torch.cat([v[:, :, :nm], new_v], 2)
        mp_all = torch.cat([pos[:, :, :nm], new_p], 2)
        ms_all = torch.cat([size[:, :, :nm], new_s], 2)
        sel_m = compact_valid(mp_all[:, 0] >= 0)
        # exact region: what stays; padding dropped
        sel_r = compact_valid(keep) + nm
        keep_sel = keep.gather(1, sel_r - nm)
        rp = take_slots(pos, sel_r)
        rp = torch.where(keep_sel[:, None, :], rp, torch.full_like(rp, -1))
        self.keys = torch.cat([take_slots(mk_all, sel_m), take_slots(k, sel_r)], 2)
        self.values = torch.cat([take_slots(mv_all, sel_m), take_slots(v, sel_r)], 2)
        self.pos = torch.cat([take_slots(mp_all, sel_m), rp], 2)
        self.size = torch.cat([take_slots(ms_all, sel_m), take_slots(size, sel_r)], 2)
        if self.score is not None:  # centroids are never merged again: their score no longer matters
            self.score = torch.cat([self.score.new_zeros(B, H, sel_m.shape[1]), take_slots(self.score, sel_r)], 2)
        self.n_merged = sel_m.shape[1]

    # ---- attention ---------------------------------------------------------------------------
    def decode(self, query, qpos, scaling):
        """Slot attention with ``log(cluster size)`` added to each merged key's score (``size_bias``): one
        :func:`attend_slots` call over all slots (a single-token step on the Triton path is one fused
        :func:`kvkit.kernels.decode` launch with the log-weights and pos/qpos causality)."""
        T = query.shape[2]
        lw = self.size.float().clamp(min=1).log() if self.p.size_bias else None
        return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling, log_weight=lw,
                            dense=self.dense_decode(T))
