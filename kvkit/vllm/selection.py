"""Block selection from key summaries: what the ``tidal`` and ``quest`` plans share.

A selection layer scores each block of each long decode row from its own query and per-block key summaries kept as
keys are written, softmax-normalises the scores per query head, takes the max over heads (and over the TP group, so
every rank reads the same blocks) and keeps the sink blocks, the last block and the top-k others
(:meth:`BlockSelection.select`: a reduced block table, :mod:`kvkit.vllm.reads`). Two summaries:

* ``exact`` (TidalDecode): a copy of the selection layers' keys ``[slots, kv_heads, D]``; a block scores the max
  softmax probability of q.k over its tokens (the layer reads everything anyway);
* ``quest`` (Quest, arXiv:2406.10774): per-block key max / min ``[blocks, kv_heads, D]`` fp32; a block scores Quest's
  upper bound ``sum_d max(q_d * kmax_d, q_d * kmin_d)``.

Nothing here imports vLLM.
"""

from __future__ import annotations

import torch

from kvkit.vllm import reads
from kvkit.vllm.reads import BlockBudget, StepReads


class BlockSummaries:
    """One attention layer's key summaries (``exact``: ``keys``; ``quest``: ``kmax`` / ``kmin``), kept for the
    ``select_layers`` only and allocated on the first write at the cache's size."""

    def __init__(self, select_layers: tuple[int, ...], score: str, head_size: int, tp):
        self.select_layers = select_layers
        self.score = score
        self.head_size = head_size
        self.tp = tp
        self.kmax: torch.Tensor | None = None  # quest: per-block key max [blocks, kv_heads, D]
        self.kmin: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None  # exact: the layer's keys [slots, kv_heads, D]

    def update(self, key: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Fold the step's new keys ``[tokens, kv_heads, D]`` (written to ``slot_mapping``) into the summaries; a
        block written from its first slot is a new block (its old max / min are reset)."""
        num_blocks, kv_heads, block_size, _ = kv_cache.shape
        if self.score == "quest" and (self.kmax is None or self.kmax.shape[0] != num_blocks):
            self.kmax = torch.full((num_blocks, kv_heads, self.head_size), float("-inf"))
            self.kmin = torch.full((num_blocks, kv_heads, self.head_size), float("inf"))
        n = min(key.shape[0], slot_mapping.shape[0])
        slots = slot_mapping[:n]
        valid = slots >= 0
        if not bool(valid.all()):
            slots, k = slots[valid], key[:n][valid]
        else:
            k = key[:n]
        blk = (slots // block_size).long()
        fresh = blk[(slots % block_size) == 0]
        if fresh.numel() and self.kmax is not None:
            self.kmax[fresh] = float("-inf")
            self.kmin[fresh] = float("inf")
        if self.score == "exact":
            if self.keys is None or self.keys.shape[0] != num_blocks * block_size:
                self.keys = torch.zeros((num_blocks * block_size, kv_heads, self.head_size), dtype=key.dtype)
            self.keys.index_copy_(0, slots.long(), k.to(self.keys.dtype))
            return
        kf = k.float()
        self.kmax.index_reduce_(0, blk, kf, "amax")
        self.kmin.index_reduce_(0, blk, kf, "amin")


class BlockSelection(BlockBudget):
    """Hooks of a plan that selects blocks per decode row (tidal, quest); it defines ``select_layers(num_layers)``
    (the layers that select) and ``summary_score`` (``"exact"`` or ``"quest"``)."""

    def check_layers(self, num_layers: int) -> None:
        if num_layers < 3:
            raise ValueError(f"kvkit.vllm: {self.name} needs at least 3 layers (layers 0-1 read everything, "
                             f"layer 2 is the first selection layer); this model has {num_layers}")
        self.select_layers(num_layers)

    def plan_step(self, builder, md, num_reqs: int, force_full: bool) -> StepReads:
        bs = builder.block_size
        rows = reads.decode_rows(md, num_reqs, bs)
        step = reads.new_step(rows, bs)
        step.select_layers = self.select_layers(builder.num_layers)
        if not force_full and step.select_layers:  # fewer than 3 layers: nothing to select from
            reads.reduce_rows(builder, md, rows, step, self.budget_blocks(bs))
        return step

    def layer_state(self, impl, ctx) -> BlockSummaries:
        return BlockSummaries(self.select_layers(ctx.num_layers), self.summary_score, impl.head_size, ctx.tp)

    def write(self, impl, state: BlockSummaries, layer, key, value, kv_cache, slot_mapping) -> None:
        impl.vllm_write(layer, key, value, kv_cache, slot_mapping)
        if state.select_layers and impl.kvkit_layer(layer) in state.select_layers:
            state.update(key, kv_cache, slot_mapping)

    def select(self, impl, state: BlockSummaries, step: StepReads, query: torch.Tensor, md):
        """The metadata reading each long decode row's sink blocks, top-k scored blocks and last block (``md`` with
        a reduced table), from this layer's ``query`` [tokens, heads, D]; ``step.reduced`` if nothing is
        summarised yet."""
        if state.kmax is None and state.keys is None:
            return step.reduced
        bs, rows, nb = step.block_size, step.rows, step.nb
        n, maxnb = rows.numel(), int(nb.max())
        k, s = self.budget_blocks(bs), self.sink_blocks(bs)
        q = query[md.query_start_loc[rows].long()].float()  # [n, H, D]
        kvh = impl.num_kv_heads
        q = q.view(n, kvh, impl.num_queries_per_kv, impl.head_size)
        tbl = md.block_table[rows, :maxnb].long()
        pos = torch.arange(maxnb)
        valid = pos.unsqueeze(0) < nb.unsqueeze(1)  # [n, maxnb]
        if state.keys is not None:
            slots = (tbl.unsqueeze(-1) * bs + torch.arange(bs)).view(n, maxnb * bs)
            keys = state.keys[slots].to(q.dtype).permute(0, 2, 3, 1)  # [n, kvh, D, maxnb*bs]
            score = torch.matmul(q, keys) * impl.scale  # [n, kvh, G, maxnb*bs]
            seq = md.seq_lens[rows].long()
            tok_ok = torch.arange(maxnb * bs).unsqueeze(0) < seq.unsqueeze(1)
            score = score.masked_fill(~tok_ok[:, None, None, :], float("-inf"))
            agg = torch.softmax(score, dim=-1).view(n, kvh, -1, maxnb, bs).amax(dim=(1, 2, 4))
        else:
            kmax = state.kmax[tbl].transpose(1, 2)  # [n, kvh, maxnb, D]
            kmin = state.kmin[tbl].transpose(1, 2)
            score = torch.matmul(q.clamp(min=0), kmax.transpose(-1, -2)) + torch.matmul(
                q.clamp(max=0), kmin.transpose(-1, -2)
            )  # [n, kvh, G, maxnb]
            score = (score * impl.scale).masked_fill(~valid[:, None, None, :], float("-inf"))
            agg = torch.softmax(score, dim=-1).amax(dim=(1, 2))  # [n, maxnb]
        # each rank holds a slice of the heads: the max over all heads of the model, so TP=N selects as TP=1
        state.tp.max_(agg)
        forced = (pos.unsqueeze(0) < s) | (pos.unsqueeze(0) == (nb - 1).unsqueeze(1))
        agg = agg.masked_fill(forced, -1.0).masked_fill(~valid, -2.0)
        top = agg.topk(k - s - 1, dim=1).indices.sort(dim=1).values
        cols = torch.cat([torch.arange(s).expand(n, s), top, (nb - 1).unsqueeze(1)], dim=1)
        return reads.with_table(md, step, rows, cols)
