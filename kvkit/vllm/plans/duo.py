"""``duo`` (DuoAttention): per KV head, a retrieval head reads every block, a streaming head the sink + recent blocks.

The pattern is kvkit's (``kvkit.policies.duo``: the one shipped for the model, or ``pattern=``), binarised with
``sparsity`` as ``kvkit.patch(model, "duo")`` does; each rank takes the columns of its KV heads
(:meth:`DuoPlan.retrieval_heads`). A streaming head of a decode row reads blocks ``[0, S)`` and
``[max(S, (seq_len - recent) // bs), ceil(seq_len / bs))`` with ``S = ceil(sink / bs)``: at least DuoAttention's
window, rounded out to blocks.

vLLM's op takes one block table per row for all heads, so per layer (this rank's heads of the pattern):

* all retrieval: vLLM's op on the full tables (bit-identical to vanilla);
* all streaming: vLLM's op on tables reduced to the streaming blocks (:meth:`DuoStep.stream_md`);
* mixed: :func:`kvkit.kernels.paged_heads_cpu.decode_rows` (C) attends each long decode row with one block list per
  (row, KV head) (:meth:`DuoStep.lists`: ``[rows, H, W]`` blocks, ``[rows, H]`` tokens); other rows of the step
  (prefill, short decode) run vLLM's op first on :meth:`DuoStep.trim_md`, where the kernel's rows read one block
  (their output is overwritten).

Prefill rows and decode rows whose context fits in the window run vLLM's op unchanged. ``KVKIT_VLLM_DUO_KERNEL=always``
runs the kernel on uniform layers too. Reads are counted per (block, KV head) (``StepRecord.head_blocks_read``).
Every block stays held for every head: vLLM's pages span all KV heads of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvkit import env
from kvkit.kernels import paged_heads_cpu as PH
from kvkit.vllm import reads
from kvkit.vllm.plans import register
from kvkit.vllm.plans.base import Plan, require_int, set_default
from kvkit.vllm.stats import STATS, StepRecord

SINK_DEFAULT = 64  # DuoAttention's deploy setting (sink 64, recent 256; arXiv:2410.10819)


@dataclass
class DuoStep:
    """What the decode rows of one step read, per kind of head; shared by every layer of the group."""

    block_size: int
    record: StepRecord
    full_read: int  # blocks of the decode rows, one layer (what a retrieval head reads)
    stream_read: int  # blocks a streaming head reads over the decode rows, one layer
    rows: torch.Tensor | None = None  # decode rows whose streaming heads read fewer blocks (None: none)
    tok: torch.Tensor | None = None  # their query tokens
    full_tbl: torch.Tensor | None = None  # [nr, W] int32: every block
    full_ntok: torch.Tensor | None = None  # [nr] int32
    stream_tbl: torch.Tensor | None = None  # [nr, W] int32: sink blocks, then the recent blocks (padded)
    stream_ntok: torch.Tensor | None = None  # [nr] int32
    last_fill: torch.Tensor | None = None  # [nr] tokens in each row's last block
    need_op: bool = False  # other rows (prefill, short decode) need vLLM's op in mixed layers
    num_reqs: int = 0
    md: object = None  # vLLM's CPUAttentionMetadata of the step
    builder: object = None
    _lists: dict = field(default_factory=dict)
    _stream_md: object = None
    _trim_md: object = None

    def lists(self, retrieval: tuple[bool, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-(row, KV head) block lists ``[nr, H, W]`` and token counts ``[nr, H]`` for a layer's heads."""
        if retrieval not in self._lists:
            m = torch.tensor(retrieval, dtype=torch.bool)
            blocks = torch.where(m.view(1, -1, 1), self.full_tbl.unsqueeze(1), self.stream_tbl.unsqueeze(1))
            ntok = torch.where(m.view(1, -1), self.full_ntok.unsqueeze(1), self.stream_ntok.unsqueeze(1))
            self._lists[retrieval] = (blocks.contiguous(), ntok.contiguous())
        return self._lists[retrieval]

    def stream_md(self):
        """vLLM's op with every long decode row reduced to its streaming blocks (layers of streaming heads only)."""
        if self._stream_md is None:
            md = self.md
            table, seq = md.block_table.clone(), md.seq_lens[: self.num_reqs].clone()
            table[self.rows, : self.stream_tbl.shape[1]] = self.stream_tbl.to(table.dtype)
            seq[self.rows] = self.stream_ntok.to(seq.dtype)
            self._stream_md = replace(md, block_table=table, seq_lens=seq,
                                      scheduler_metadata=self.builder.sched(md, seq))
        return self._stream_md

    def trim_md(self):
        """vLLM's op for the other rows; the kernel's rows read only their last block there (output overwritten)."""
        if self._trim_md is None:
            md = self.md
            table, seq = md.block_table.clone(), md.seq_lens[: self.num_reqs].clone()
            last = (self.full_ntok.long() + self.block_size - 1) // self.block_size - 1
            table[self.rows, 0] = self.full_tbl.gather(1, last.unsqueeze(1)).squeeze(1).to(table.dtype)
            seq[self.rows] = self.last_fill.to(seq.dtype)
            self._trim_md = replace(md, block_table=table, seq_lens=seq, scheduler_metadata=self.builder.sched(md, seq))
        return self._trim_md


@dataclass
class DuoLayer:
    """One attention layer's duo state: the pattern of this rank's KV heads and the kernel switch."""

    retrieval: torch.Tensor  # [layers, this rank's KV heads] bool (True: retrieval head)
    kernel: str  # KVKIT_VLLM_DUO_KERNEL: "mixed" (the kernel on mixed layers) or "always"
    mask: tuple[bool, ...] | None = None  # this layer's row of ``retrieval``, read on its first forward


_RETRIEVAL_CACHE: dict = {}  # (plan, id(hf_config)) -> the binarised pattern of the whole model


@register("duo")
@dataclass(frozen=True)
class DuoPlan(Plan):
    """sink : tokens a streaming head reads at the start of its context (None: 64, DuoAttention's deploy setting).
    recent : tokens a streaming head reads at the end of its context (DuoAttention's deploy setting 256).
    pattern : a DuoAttention pattern file (kvkit JSON or the reference TSV); None: the one kvkit ships for the model
        (``kvkit.policies.duo.shipped_pattern``), an error if none ships.
    sparsity : fraction of KV heads made streaming heads (global quantile of the pattern's gates); None: 0.5 for GQA
        models, 0.75 for MHA (the paper's and ``kvkit.patch(model, "duo")``'s default).

    The pattern file is read and checked when the plan is built (:attr:`kvkit_policy` keeps it); its shape against
    the model when the engine's config names the model."""

    sink: int | None = None
    recent: int = 256
    pattern: str | None = None
    sparsity: float | None = None

    def check(self) -> None:
        set_default(self, "sink", SINK_DEFAULT)
        require_int(self, "sink")
        require_int(self, "recent", minimum=1)
        sp = self.sparsity
        if sp is not None and (isinstance(sp, bool) or not isinstance(sp, (int, float)) or not 0 <= sp <= 1):
            raise ValueError(f"kvkit.vllm: sparsity must be a fraction in [0, 1], got {sp!r}")
        if self.pattern is not None and not isinstance(self.pattern, str):
            raise ValueError(f"kvkit.vllm: pattern must be a file path, got {type(self.pattern).__name__}")

    def hf_options(self) -> dict:
        return dict(pattern=self.pattern, sparsity=self.sparsity, sink=self.sink, recent=self.recent)

    # --- block geometry ------------------------------------------------------------------------------------------
    def sink_blocks(self, block_size: int) -> int:
        return reads.sink_blocks(self.sink, block_size)

    def recent_start_block(self, seq_len: int, block_size: int) -> int:
        """The first block of a streaming head's recent window (it reads blocks ``[0, sink_blocks)`` and
        ``[max(sink_blocks, this), ceil(seq_len / block_size))``)."""
        return max(self.sink_blocks(block_size), max(0, seq_len - self.recent) // block_size)

    def retrieval_heads(self, vllm_config, local_kv_heads: int, tp) -> torch.Tensor:
        """``[layers, local_kv_heads]`` bool (True: retrieval head) for this rank's KV heads. Tensor parallelism:
        vLLM gives rank ``r`` the KV heads ``[r * H / tp, (r + 1) * H / tp)``, or, with fewer KV heads than ranks,
        replicates head ``r // (tp / H)``."""
        if vllm_config is None:
            raise RuntimeError("kvkit.vllm duo: no vLLM config in this context (the model config gives the pattern)")
        hf = vllm_config.model_config.hf_config
        tc = vllm_config.model_config.hf_text_config
        total = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
        key = (self, id(hf))
        if key not in _RETRIEVAL_CACHE:
            try:  # the pattern read and checked when the switch was parsed
                _RETRIEVAL_CACHE[key] = self.kvkit_policy.retrieval_heads(hf)
            except ValueError as e:
                raise ValueError(f"kvkit.vllm: {e}") from None
        full = _RETRIEVAL_CACHE[key]
        size, rank = tp.size(), tp.rank()
        if total >= size:
            if local_kv_heads * size != total:
                raise ValueError(f"kvkit.vllm duo: {local_kv_heads} KV heads per rank x TP {size} != {total} KV heads")
            heads = list(range(rank * local_kv_heads, (rank + 1) * local_kv_heads))
        else:
            heads = [rank // (size // total)]
        return full[:, heads].clone()

    # --- engine hooks --------------------------------------------------------------------------------------------
    def layer_state(self, impl, ctx) -> DuoLayer | None:
        if not ctx.decoder:
            return None
        if impl.sinks is not None or impl.alibi_slopes is not None or impl.logits_soft_cap or \
                impl.kv_cache_dtype != "auto":
            raise NotImplementedError("kvkit.vllm duo: attention sinks, ALiBi, logit soft-capping and "
                                      "kv_cache_dtype other than 'auto' are not supported")
        kernel = env.vllm_duo_kernel()
        if kernel not in ("mixed", "always"):
            raise ValueError(f"kvkit.vllm: KVKIT_VLLM_DUO_KERNEL must be 'mixed' or 'always', got {kernel!r}")
        return DuoLayer(self.retrieval_heads(ctx.vllm_config, impl.num_kv_heads, ctx.tp), kernel)

    def plan_step(self, builder, md, num_reqs: int, force_full: bool) -> DuoStep:
        """The decode rows whose context reaches past a streaming head's window, and both block lists of each
        (every block; sink blocks + the blocks of the last ``recent`` tokens)."""
        bs = builder.block_size
        r = reads.decode_rows(md, num_reqs, bs, torch.long)
        seq, nb, decode = r.seq, r.nb, r.decode
        full_read = r.full_read
        rec = STATS.new_step(int(decode.sum()), full_read)
        rec.kv_heads = builder.num_kv_heads
        step = DuoStep(bs, rec, full_read, full_read)
        if force_full or not bool(decode.any()):
            return step
        S = self.sink_blocks(bs)
        first = torch.clamp((seq - self.recent).clamp_min(0) // bs, min=S)  # first block of the recent window
        reduce = decode & (first > S)
        if not bool(reduce.any()):
            return step
        rows = reduce.nonzero().squeeze(1)
        rnb, rfirst, rseq = nb[rows], first[rows], seq[rows]
        cnt = S + rnb - rfirst  # blocks a streaming head reads
        W = int(rnb.max())
        full_tbl = md.block_table[rows, :W].to(torch.int32)
        j = torch.arange(W).unsqueeze(0)
        col = torch.where(j < S, j, rfirst.unsqueeze(1) + (j - S))
        col = torch.where(j < cnt.unsqueeze(1), col, 0)
        last_fill = rseq - (rnb - 1) * bs
        step.rows, step.tok = rows, r.qsl[rows].long()
        step.full_tbl, step.full_ntok = full_tbl.contiguous(), rseq.to(torch.int32)
        step.stream_tbl = full_tbl.gather(1, col).contiguous()
        step.stream_ntok = ((cnt - 1) * bs + last_fill).to(torch.int32)
        step.last_fill = last_fill
        step.stream_read = full_read - int(rnb.sum()) + int(cnt.sum())
        step.need_op = not bool(reduce.all())  # prefill rows or decode rows within the window
        step.md, step.builder, step.num_reqs = md, builder, num_reqs
        return step

    def forward(self, impl, state: DuoLayer | None, step: DuoStep, layer, query, key, value, kv_cache, md, output,
                output_scale=None, output_block_scale=None):
        if state is None:  # not decoder self-attention: vLLM's op
            return impl.vllm_forward(layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvkit.vllm duo: fused output quantization is not supported")
        reads.check_block_size(kv_cache, step.block_size)
        if state.mask is None:
            state.mask = tuple(bool(x) for x in state.retrieval[impl.kvkit_layer(layer)].tolist())
        mask = state.mask
        H, n_ret = len(mask), sum(mask)
        rec = step.record
        rec.layer_calls += 1
        rec.head_blocks_read += n_ret * step.full_read + (H - n_ret) * step.stream_read
        rec.blocks_read = rec.head_blocks_read / H
        everywhere = state.kernel == "always"
        if step.rows is None or (n_ret == H and not everywhere):
            return impl.vllm_forward(layer, query, key, value, kv_cache, md, output)
        if n_ret == 0 and not everywhere:
            return impl.vllm_forward(layer, query, key, value, kv_cache, step.stream_md(), output)
        if step.need_op:  # prefill rows / short decode rows; the kernel's rows read one block there, overwritten
            impl.vllm_forward(layer, query, key, value, kv_cache, step.trim_md(), output)

        blocks, ntok = step.lists(mask)
        key_cache, value_cache = PH.split_cache(kv_cache)
        PH.decode_rows(query.view(query.shape[0], -1, impl.head_size), step.tok, key_cache, value_cache, blocks, ntok,
                       impl.scale, PH.layout_for_isa(layer.isa), output.view(output.shape[0], -1, impl.head_size))
        return output
