"""Reduced block tables: the decode reads of the plans that read the same blocks in every KV head.

Used by the ``full``, ``streaming``, ``tidal`` and ``quest`` plans (:mod:`kvkit.vllm.plans`). A decode row (one query
token) whose context spans more than ``k`` blocks reads only ``k`` of them: vLLM's C++ op
``cpu_attention_with_kv_cache`` runs unchanged on a copy of the step's metadata whose block table lists, for that
row, the ``k`` blocks chosen (in context order) and whose ``seq_len`` is shortened to the tokens in them. vLLM caches
keys after RoPE, and the op's only use of positions at decode is the causal bound (a single query token sees every
key it is given), so this is exact attention over the blocks listed. Every listed block but the last is full, so
the shortened ``seq_len`` is ``(k - 1) * block_size + tokens in the last block``. Prefill rows (more than one query
token) keep their full table.

Counters: one :class:`kvkit.vllm.stats.StepRecord` per step (the decode rows' blocks in one layer), and per layer the
blocks handed to the op for them (:func:`read`).

Nothing here imports vLLM (the scheduler metadata comes from the builder's ``sched``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvkit.vllm.stats import STATS, StepRecord

SINK_DEFAULT = 4  # streaming / tidal / quest: leading tokens always read (StreamingLLM's 4)


def sink_blocks(sink: int, block_size: int) -> int:
    """Blocks holding the first ``sink`` tokens (0: none)."""
    return math.ceil(sink / block_size) if sink > 0 else 0


class BlockBudget:
    """Block geometry of a plan with ``budget`` and ``sink`` options (tokens), at vLLM's block size."""

    def sink_blocks(self, block_size: int) -> int:
        return sink_blocks(self.sink, block_size)

    def budget_blocks(self, block_size: int) -> int:
        """Blocks read per decoded token (sinks + the rest), at least sinks + 1."""
        return max(math.ceil(self.budget / block_size), self.sink_blocks(block_size) + 1)

    def recent_blocks(self, block_size: int) -> int:
        return self.budget_blocks(block_size) - self.sink_blocks(block_size)


@dataclass
class StepReads:
    """What the decode rows of one step read; shared by every layer of the KV-cache group."""

    block_size: int
    record: StepRecord
    full_read: int  # blocks of the decode rows, one layer
    rows: torch.Tensor | None = None  # indices of the decode rows that read fewer blocks
    nb: torch.Tensor | None = None  # their block counts
    reduced_read: int = 0  # blocks the reduced table hands the op, one layer
    reduced: object = None  # CPUAttentionMetadata with the reduced table (streaming: built once; tidal: per selection)
    reduced_seq_lens: torch.Tensor | None = None  # [num_reqs] the rows' seq_lens, ``rows`` shortened
    reduced_sched: torch.Tensor | None = None  # vLLM's scheduler metadata for them
    select_layers: tuple[int, ...] = ()  # tidal / quest: the layers that select


@dataclass
class Rows:
    """The rows of a step: ``qsl`` [num_reqs + 1] query start offsets, ``seq`` [num_reqs] context lengths (the query
    tokens included), ``nb`` [num_reqs] their block counts, ``decode`` [num_reqs] bool (one query token)."""

    qsl: torch.Tensor
    seq: torch.Tensor
    nb: torch.Tensor
    decode: torch.Tensor

    @property
    def full_read(self) -> int:
        return int(self.nb[self.decode].sum())


def decode_rows(md, num_reqs: int, block_size: int, dtype: torch.dtype | None = None) -> Rows:
    """The rows of vLLM's metadata ``md`` (``seq`` and ``nb`` in ``dtype``, default: vLLM's)."""
    qsl = md.query_start_loc[: num_reqs + 1]
    seq = md.seq_lens[:num_reqs]
    if dtype is not None:
        seq = seq.to(dtype)
    nb = (seq + block_size - 1) // block_size
    return Rows(qsl, seq, nb, (qsl[1:] - qsl[:-1]) == 1)


def new_step(rows: Rows, block_size: int) -> StepReads:
    """A step whose decode rows read every block (counted in ``STATS``); :func:`reduce_rows` reduces it."""
    full_read = rows.full_read
    return StepReads(block_size, STATS.new_step(int(rows.decode.sum()), full_read), full_read)


def reduce_rows(builder, md, rows: Rows, step: StepReads, k: int) -> bool:
    """Mark the decode rows of more than ``k`` blocks as reading ``k`` (``step.rows``, their seq_lens and scheduler
    metadata); the blocks themselves are chosen by the plan (:func:`with_table`). False: no row to reduce."""
    reduce = rows.decode & (rows.nb > k)
    if not bool(reduce.any()):
        return False
    bs, seq = step.block_size, rows.seq
    idx = reduce.nonzero().squeeze(1)
    rnb = rows.nb[idx]
    last_fill = seq[idx] - (rnb - 1) * bs
    red_seq = seq.clone()
    red_seq[idx] = ((k - 1) * bs + last_fill).to(seq.dtype)
    step.rows, step.nb = idx, rnb
    step.reduced_read = step.full_read - int(rnb.sum()) + k * idx.numel()
    step.reduced_seq_lens = red_seq
    step.reduced_sched = builder.sched(md, red_seq)
    return True


def with_table(md, step: StepReads, rows: torch.Tensor, cols: torch.Tensor):
    """A copy of ``md`` whose decode rows ``rows`` list the blocks at positions ``cols`` [n, k] of their tables."""
    table = md.block_table.clone()
    table[rows, : cols.shape[1]] = md.block_table[rows].gather(1, cols.to(md.block_table.dtype).long())
    return replace(md, block_table=table, seq_lens=step.reduced_seq_lens, scheduler_metadata=step.reduced_sched)


def check_block_size(kv_cache: torch.Tensor, block_size: int) -> None:
    """The layer's cache view ``[num_blocks, kv_heads, block_size, ...]`` has the block size the step was planned at."""
    if kv_cache.shape[2] != block_size:
        raise RuntimeError(f"kvkit.vllm: kernel block size {kv_cache.shape[2]} != manager block size {block_size}")


def begin_layer(step: StepReads, kv_cache: torch.Tensor) -> None:
    """Start a layer's forward on ``step`` (checked, counted)."""
    check_block_size(kv_cache, step.block_size)
    step.record.layer_calls += 1


def read(impl, step: StepReads, read_md, layer, query, key, value, kv_cache, md, output, output_scale=None,
         output_block_scale=None):
    """vLLM's op over ``read_md`` (``md`` itself: every block; else ``step``'s reduced reads), counted."""
    step.record.blocks_read += step.reduced_read if read_md is not md else step.full_read
    return impl.vllm_forward(layer, query, key, value, kv_cache, read_md, output, output_scale, output_block_scale)
