"""kvkit's CPU attention backend for vLLM: vLLM's own C++ op over reduced block tables.

``KvkitCPUAttentionBackend`` subclasses vLLM's ``CPUAttentionBackend`` and is registered in
place of ``CPU_ATTN`` by :func:`kvkit.vllm.register`. With no policy switched on for the engine,
its builder and impl call vLLM's code and nothing else (plugin off == vanilla).

With a policy, the metadata builder plans each step: a decode row (one query token) whose context
spans more than ``budget_blocks`` blocks reads only ``budget_blocks`` of them. vLLM caches keys
after RoPE, and the op's only use of positions at decode is the causal bound (a single query
token sees every key it is given), so attending over a block table that lists a subset of a
request's blocks, with ``seq_len`` shortened to the tokens in those blocks, is exact attention over
the blocks read. Every listed block except the last is full, so the shortened ``seq_len`` is
``(k - 1) * block_size + tokens in the last block``. Prefill rows keep their full table.

* ``streaming``: sink blocks + the most recent blocks, in every layer (StreamingLLM); with
  ``free=1`` the spec from :meth:`customize_spec` lets vLLM's block manager free the middle.
* ``tidal``: layers 0, 1 and the selection layers (2 and ``round(0.4 L)``) read every block; a
  selection layer then scores each block of each decode row with Quest's bound
  ``sum_d max(q_d * kmax_d, q_d * kmin_d)`` from per-block key summaries (kept incrementally for
  those layers only, as keys are written), softmax-normalises per query head, takes the max over
  heads and keeps the sink blocks, the last block and the top-k others. The following layers reuse
  that block table (TidalDecode's position persistence) until the next selection layer.

* ``duo`` (DuoAttention): a per-model pattern makes each KV head of each layer a retrieval head
  (reads every block) or a streaming head (reads the sink blocks + the blocks of the last ``recent``
  tokens). vLLM's op takes one block table per row, shared by all heads, so a layer that mixes both
  kinds runs kvkit's per-(row, KV head) C kernel (:mod:`kvkit.kernels.paged_heads_cpu`) on its long
  decode rows; a layer whose local heads are all retrieval (all streaming) runs vLLM's op on the full
  (streaming-reduced) tables; prefill rows and decode rows whose context fits in the window run
  vLLM's op unchanged.

The same plan (a reduced ``block_table`` + ``seq_lens`` per decode row, built in the metadata
builder, the selection in the impl) carries over to a GPU backend whose kernel takes block tables
and sequence lengths (FlashAttention's ``block_table`` / ``seqused_k``); that path is not built or
tested here (no GPU on this machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvkit import env
from kvkit.vllm.config import PluginPolicy, policy_from
from kvkit.vllm.stats import STATS, StepRecord

_last_policy: PluginPolicy | None = None  # the policy of the engine built last in this process
_force_full = False  # benchmarks: read every block this step (vLLM's own read) without rebuilding the engine


def force_full_reads(on: bool) -> None:
    """Benchmark A/B switch: while on, decode rows read every block (the op gets vLLM's own tables).

    The KV held (and, under streaming, freed) is unchanged, so this only compares reads, step by step,
    on the same engine, batch and cache. Key summaries keep being updated, so tidal can switch back.
    """
    global _force_full
    _force_full = bool(on)


def _engine_policy(vllm_config) -> PluginPolicy | None:
    global _last_policy
    policy = policy_from(vllm_config)
    _last_policy = policy
    return policy


@dataclass
class StepPlan:
    """What the decode rows of one step read; shared by every layer of the KV-cache group."""

    policy: PluginPolicy
    block_size: int
    record: StepRecord
    full_read: int  # blocks of the decode rows, one layer
    rows: torch.Tensor | None = None  # indices of the decode rows that read fewer blocks
    nb: torch.Tensor | None = None  # their block counts
    reduced_read: int = 0  # blocks the reduced table hands the op, one layer
    reduced: CPUAttentionMetadata | None = None  # streaming: built once; tidal: after each selection
    reduced_seq_lens: torch.Tensor | None = None
    reduced_sched: torch.Tensor | None = None
    select_layers: tuple[int, ...] = ()


@dataclass
class DuoPlan:
    """duo: what the decode rows of one step read, per kind of head; shared by every layer of the group."""

    policy: PluginPolicy
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
    md: CPUAttentionMetadata | None = None
    builder: object = None
    _lists: dict = field(default_factory=dict)
    _stream_md: CPUAttentionMetadata | None = None
    _trim_md: CPUAttentionMetadata | None = None

    def lists(self, retrieval: tuple[bool, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-(row, KV head) block lists ``[nr, H, W]`` and token counts ``[nr, H]`` for a layer's heads."""
        if retrieval not in self._lists:
            m = torch.tensor(retrieval, dtype=torch.bool)
            blocks = torch.where(m.view(1, -1, 1), self.full_tbl.unsqueeze(1), self.stream_tbl.unsqueeze(1))
            ntok = torch.where(m.view(1, -1), self.full_ntok.unsqueeze(1), self.stream_ntok.unsqueeze(1))
            self._lists[retrieval] = (blocks.contiguous(), ntok.contiguous())
        return self._lists[retrieval]

    def stream_md(self) -> CPUAttentionMetadata:
        """vLLM's op with every long decode row reduced to its streaming blocks (layers of streaming heads only)."""
        if self._stream_md is None:
            md = self.md
            table, seq = md.block_table.clone(), md.seq_lens[: self.num_reqs].clone()
            table[self.rows, : self.stream_tbl.shape[1]] = self.stream_tbl.to(table.dtype)
            seq[self.rows] = self.stream_ntok.to(seq.dtype)
            self._stream_md = replace(md, block_table=table, seq_lens=seq,
                                      scheduler_metadata=self.builder.sched(md, seq))
        return self._stream_md

    def trim_md(self) -> CPUAttentionMetadata:
        """vLLM's op for the other rows; the kernel's rows read only their last block there (output overwritten)."""
        if self._trim_md is None:
            md = self.md
            table, seq = md.block_table.clone(), md.seq_lens[: self.num_reqs].clone()
            last = (self.full_ntok.long() + self.block_size - 1) // self.block_size - 1
            table[self.rows, 0] = self.full_tbl.gather(1, last.unsqueeze(1)).squeeze(1).to(table.dtype)
            seq[self.rows] = self.last_fill.to(seq.dtype)
            self._trim_md = replace(md, block_table=table, seq_lens=seq, scheduler_metadata=self.builder.sched(md, seq))
        return self._trim_md


class KvkitCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.policy = _engine_policy(vllm_config)
        self.num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        if self.policy is not None and self.policy.name != "full" and self.window_size != -1:
            raise ValueError(
                f"kvkit.vllm: policy {self.policy.name!r} on a sliding-window model is not supported "
                "(the model's own window already bounds what attention reads)"
            )

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.policy is None or self.is_cross_attention or self.is_encoder_only_attention:
            return md
        if self.policy.name == "quant":
            from kvkit.vllm import quant

            md.kvkit_quant = quant.build_plan(self, md, common_attn_metadata.num_reqs)
            return md
        if self.policy.name == "duo":
            md.kvkit_duo = self._plan_duo(md, common_attn_metadata.num_reqs)
            return md
        md.kvkit = self._plan(md, common_attn_metadata.num_reqs)
        return md

    def sched(self, md: CPUAttentionMetadata, seq_lens: torch.Tensor) -> torch.Tensor:
        """vLLM's scheduler metadata for ``md`` with other ``seq_lens``."""
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=md.query_start_loc,
            causal=md.causal, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=md.dynamic_causal,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def _plan_duo(self, md: CPUAttentionMetadata, num_reqs: int) -> DuoPlan:
        """duo: the decode rows whose context reaches past a streaming head's window, and both block lists of
        each (every block; sink blocks + the blocks of the last ``recent`` tokens)."""
        p, bs = self.policy, self.block_size
        qsl = md.query_start_loc[: num_reqs + 1]
        seq = md.seq_lens[:num_reqs].long()
        nb = (seq + bs - 1) // bs
        decode = (qsl[1:] - qsl[:-1]) == 1
        full_read = int(nb[decode].sum())
        rec = STATS.new_step(int(decode.sum()), full_read)
        rec.kv_heads = self.num_kv_heads
        plan = DuoPlan(p, bs, rec, full_read, full_read)
        if _force_full or not bool(decode.any()):
            return plan
        S = p.sink_blocks(bs)
        first = torch.clamp((seq - p.recent).clamp_min(0) // bs, min=S)  # first block of the recent window
        reduce = decode & (first > S)
        if not bool(reduce.any()):
            return plan
        rows = reduce.nonzero().squeeze(1)
        rnb, rfirst, rseq = nb[rows], first[rows], seq[rows]
        cnt = S + rnb - rfirst  # blocks a streaming head reads
        W = int(rnb.max())
        full_tbl = md.block_table[rows, :W].to(torch.int32)
        j = torch.arange(W).unsqueeze(0)
        col = torch.where(j < S, j, rfirst.unsqueeze(1) + (j - S))
        col = torch.where(j < cnt.unsqueeze(1), col, 0)
        last_fill = rseq - (rnb - 1) * bs
        plan.rows, plan.tok = rows, qsl[rows].long()
        plan.full_tbl, plan.full_ntok = full_tbl.contiguous(), rseq.to(torch.int32)
        plan.stream_tbl = full_tbl.gather(1, col).contiguous()
        plan.stream_ntok = ((cnt - 1) * bs + last_fill).to(torch.int32)
        plan.last_fill = last_fill
        plan.stream_read = full_read - int(rnb.sum()) + int(cnt.sum())
        plan.need_op = not bool(reduce.all())  # prefill rows or decode rows within the window
        plan.md, plan.builder, plan.num_reqs = md, self, num_reqs
        return plan

    def _plan(self, md: CPUAttentionMetadata, num_reqs: int) -> StepPlan:
        p, bs = self.policy, self.block_size
        qsl = md.query_start_loc[: num_reqs + 1]
        seq = md.seq_lens[:num_reqs]
        nb = (seq + bs - 1) // bs
        decode = (qsl[1:] - qsl[:-1]) == 1
        full_read = int(nb[decode].sum())
        plan = StepPlan(p, bs, STATS.new_step(int(decode.sum()), full_read), full_read)
        plan.select_layers = p.select_layers(self.num_layers) if p.name in ("tidal", "quest") else ()
        k = p.budget_blocks(bs)
        reduce = decode & (nb > k)
        forced = _force_full and not (p.name == "streaming" and p.free)  # freed blocks cannot be read back
        if p.name == "full" or forced or not bool(reduce.any()):
            return plan
        if p.name in ("tidal", "quest") and not plan.select_layers:
            return plan  # fewer than 3 layers: nothing to select from
        rows = reduce.nonzero().squeeze(1)
        rnb = nb[rows]
        last_fill = seq[rows] - (rnb - 1) * bs
        red_seq = seq.clone()
        red_seq[rows] = ((k - 1) * bs + last_fill).to(seq.dtype)
        plan.rows, plan.nb = rows, rnb
        plan.reduced_read = full_read - int(rnb.sum()) + k * rows.numel()
        plan.reduced_seq_lens = red_seq
        plan.reduced_sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=num_reqs,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            seq_lens=red_seq,
            dtype=self.dtype,
            query_start_loc=md.query_start_loc,
            causal=md.causal,
            sliding_window_size=self.window_size,
            isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=md.dynamic_causal,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if p.name == "streaming":
            s, r = p.sink_blocks(bs), p.recent_blocks(bs)
            cols = torch.cat(
                [torch.arange(s).expand(rows.numel(), s), (rnb - r).unsqueeze(1) + torch.arange(r)], dim=1
            )
            plan.reduced = _with_table(md, plan, rows, cols)
        return plan


def _with_table(md: CPUAttentionMetadata, plan: StepPlan, rows: torch.Tensor, cols: torch.Tensor):
    """A copy of ``md`` whose decode rows ``rows`` list the blocks at positions ``cols`` [n, k]."""
    table = md.block_table.clone()
    table[rows, : cols.shape[1]] = md.block_table[rows].gather(1, cols.to(md.block_table.dtype).long())
    return replace(md, block_table=table, seq_lens=plan.reduced_seq_lens, scheduler_metadata=plan.reduced_sched)


class KvkitCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config_or_none()
        self.kvkit_policy = _engine_policy(vllm_config) if vllm_config is not None else _last_policy
        num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers if vllm_config is not None else 0
        p = self.kvkit_policy
        self._select_layers = p.select_layers(num_layers) if p is not None and p.name in ("tidal", "quest") else ()
        self._score = "quest" if p is not None and p.name == "quest" else (p.score if p is not None else "exact")
        self._layer_idx: int | None = None
        self._kmax: torch.Tensor | None = None  # tidal selection layers: per-block key max [blocks, kv_heads, D]
        self._kmin: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None  # tidal score=exact: selection layers' keys [slots, kv_heads, D]
        self._duo_retrieval: torch.Tensor | None = None  # duo: [layers, this rank's KV heads] bool
        self._duo_mask: tuple[bool, ...] | None = None  # duo: this layer's heads (True: retrieval)
        self._duo_kernel = env.vllm_duo_kernel()
        if p is not None and p.name == "duo" and self.attn_type == AttentionType.DECODER:
            if self.sinks is not None or self.alibi_slopes is not None or self.logits_soft_cap or \
                    self.kv_cache_dtype != "auto":
                raise NotImplementedError("kvkit.vllm duo: attention sinks, ALiBi, logit soft-capping and "
                                          "kv_cache_dtype other than 'auto' are not supported")
            if self._duo_kernel not in ("mixed", "always"):
                raise ValueError(f"kvkit.vllm: KVKIT_VLLM_DUO_KERNEL must be 'mixed' or 'always', got "
                                 f"{self._duo_kernel!r}")
            self._duo_retrieval = duo_retrieval_heads(p, vllm_config, self.num_kv_heads)

    def _layer(self, layer) -> int:
        if self._layer_idx is None:
            self._layer_idx = extract_layer_index(layer.layer_name)
        return self._layer_idx

    # --- writes: vLLM's op, plus the key summaries at tidal's selection layers ----------------------
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kvkit_policy is not None and self.kvkit_policy.name == "quant" and self.attn_type == AttentionType.DECODER:
            from kvkit.vllm import quant

            return quant.write(self, layer, key, value, kv_cache, slot_mapping)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self._select_layers and self._layer(layer) in self._select_layers:
            self._update_summaries(key, kv_cache, slot_mapping)

    def _update_summaries(self, key, kv_cache, slot_mapping) -> None:
        num_blocks, kv_heads, block_size, _ = kv_cache.shape
        if self._score == "quest" and (self._kmax is None or self._kmax.shape[0] != num_blocks):
            self._kmax = torch.full((num_blocks, kv_heads, self.head_size), float("-inf"))
            self._kmin = torch.full((num_blocks, kv_heads, self.head_size), float("inf"))
        n = min(key.shape[0], slot_mapping.shape[0])
        slots = slot_mapping[:n]
        valid = slots >= 0
        if not bool(valid.all()):
            slots, k = slots[valid], key[:n][valid]
        else:
            k = key[:n]
        blk = (slots // block_size).long()
        fresh = blk[(slots % block_size) == 0]  # a block written from its first slot: a new block
        if fresh.numel() and self._kmax is not None:
            self._kmax[fresh] = float("-inf")
            self._kmin[fresh] = float("inf")
        if self._score == "exact":
            if self._keys is None or self._keys.shape[0] != num_blocks * block_size:
                self._keys = torch.zeros((num_blocks * block_size, kv_heads, self.head_size), dtype=key.dtype)
            self._keys.index_copy_(0, slots.long(), k.to(self._keys.dtype))
            return
        kf = k.float()
        self._kmax.index_reduce_(0, blk, kf, "amax")
        self._kmin.index_reduce_(0, blk, kf, "amin")

    # --- reads ---------------------------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        qplan = getattr(attn_metadata, "kvkit_quant", None)
        if qplan is not None:
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("kvkit.vllm quant: fused output quantization is not supported")
            from kvkit.vllm import quant

            return quant.forward(self, layer, query, key, value, kv_cache, qplan, output)
        dplan: DuoPlan | None = getattr(attn_metadata, "kvkit_duo", None)
        if dplan is not None and self._duo_retrieval is not None:
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("kvkit.vllm duo: fused output quantization is not supported")
            return self._forward_duo(layer, query, key, value, kv_cache, attn_metadata, dplan, output)
        plan: StepPlan | None = getattr(attn_metadata, "kvkit", None)
        if plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if kv_cache.shape[2] != plan.block_size:
            raise RuntimeError(
                f"kvkit.vllm: kernel block size {kv_cache.shape[2]} != manager block size {plan.block_size}"
            )
        rec = plan.record
        rec.layer_calls += 1
        li = self._layer(layer)
        md = attn_metadata
        if plan.rows is not None:
            if plan.policy.name == "streaming":
                md = plan.reduced
            elif plan.policy.name == "quest":
                if li in plan.select_layers:  # this layer's own selection, from its own query, then read it
                    md = self._select(plan, query, attn_metadata) or attn_metadata
            elif li not in plan.select_layers and plan.reduced is not None and li > plan.select_layers[0]:
                md = plan.reduced
        rec.blocks_read += plan.reduced_read if md is not attn_metadata else plan.full_read
        out = super().forward(layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)
        if plan.rows is not None and plan.policy.name == "tidal" and li in plan.select_layers:
            plan.reduced = self._select(plan, query, attn_metadata)
        return out

    def _forward_duo(self, layer, query, key, value, kv_cache, md: CPUAttentionMetadata, plan: DuoPlan, output):
        """duo: retrieval heads read every block, streaming heads the sink + recent blocks (see the module doc)."""
        if kv_cache.shape[2] != plan.block_size:
            raise RuntimeError(
                f"kvkit.vllm: kernel block size {kv_cache.shape[2]} != manager block size {plan.block_size}"
            )
        if self._duo_mask is None:
            self._duo_mask = tuple(bool(x) for x in self._duo_retrieval[self._layer(layer)].tolist())
        mask = self._duo_mask
        H, n_ret = len(mask), sum(mask)
        rec = plan.record
        rec.layer_calls += 1
        rec.head_blocks_read += n_ret * plan.full_read + (H - n_ret) * plan.stream_read
        rec.blocks_read = rec.head_blocks_read / H
        everywhere = self._duo_kernel == "always"
        if plan.rows is None or (n_ret == H and not everywhere):
            return super().forward(layer, query, key, value, kv_cache, md, output)
        if n_ret == 0 and not everywhere:
            return super().forward(layer, query, key, value, kv_cache, plan.stream_md(), output)
        if plan.need_op:  # prefill rows / short decode rows; the kernel's rows read one block there, overwritten
            super().forward(layer, query, key, value, kv_cache, plan.trim_md(), output)
        from kvkit.kernels import paged_heads_cpu as PH

        blocks, ntok = plan.lists(mask)
        key_cache, value_cache = PH.split_cache(kv_cache)
        PH.decode_rows(query.view(query.shape[0], -1, self.head_size), plan.tok, key_cache, value_cache, blocks, ntok,
                       self.scale, PH.layout_for_isa(layer.isa), output.view(output.shape[0], -1, self.head_size))
        return output

    def _select(self, plan: StepPlan, query: torch.Tensor, md: CPUAttentionMetadata):
        """Quest-style block scores from the key summaries; top-k blocks per decode row."""
        if self._kmax is None and self._keys is None:
            return plan.reduced
        p, bs = plan.policy, plan.block_size
        rows, nb = plan.rows, plan.nb
        n, maxnb = rows.numel(), int(nb.max())
        k, s = p.budget_blocks(bs), p.sink_blocks(bs)
        q = query[md.query_start_loc[rows].long()].float()  # [n, H, D]
        kvh = self.num_kv_heads
        q = q.view(n, kvh, self.num_queries_per_kv, self.head_size)
        tbl = md.block_table[rows, :maxnb].long()
        pos = torch.arange(maxnb)
        valid = pos.unsqueeze(0) < nb.unsqueeze(1)  # [n, maxnb]
        if self._keys is not None:
            # TidalDecode: exact scores q.k of every token (this layer reads everything anyway); a block
            # scores the max softmax probability of its tokens over all query heads
            slots = (tbl.unsqueeze(-1) * bs + torch.arange(bs)).view(n, maxnb * bs)
            keys = self._keys[slots].to(q.dtype).permute(0, 2, 3, 1)  # [n, kvh, D, maxnb*bs]
            score = torch.matmul(q, keys) * self.scale  # [n, kvh, G, maxnb*bs]
            seq = md.seq_lens[rows].long()
            tok_ok = torch.arange(maxnb * bs).unsqueeze(0) < seq.unsqueeze(1)
            score = score.masked_fill(~tok_ok[:, None, None, :], float("-inf"))
            agg = torch.softmax(score, dim=-1).view(n, kvh, -1, maxnb, bs).amax(dim=(1, 2, 4))
        else:
            # Quest: upper bound of q.k in a block from its per-channel key min / max
            kmax = self._kmax[tbl].transpose(1, 2)  # [n, kvh, maxnb, D]
            kmin = self._kmin[tbl].transpose(1, 2)
            score = torch.matmul(q.clamp(min=0), kmax.transpose(-1, -2)) + torch.matmul(
                q.clamp(max=0), kmin.transpose(-1, -2)
            )  # [n, kvh, G, maxnb]
            score = (score * self.scale).masked_fill(~valid[:, None, None, :], float("-inf"))
            agg = torch.softmax(score, dim=-1).amax(dim=(1, 2))  # [n, maxnb]
        if get_tensor_model_parallel_world_size() > 1:
            # each rank holds a slice of the heads: take the max over all heads of the model, so every rank
            # reads the same blocks and TP=N selects exactly as TP=1
            torch.distributed.all_reduce(agg, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
        forced = (pos.unsqueeze(0) < s) | (pos.unsqueeze(0) == (nb - 1).unsqueeze(1))
        agg = agg.masked_fill(forced, -1.0).masked_fill(~valid, -2.0)
        top = agg.topk(k - s - 1, dim=1).indices.sort(dim=1).values
        cols = torch.cat([torch.arange(s).expand(n, s), top, (nb - 1).unsqueeze(1)], dim=1)
        return _with_table(md, plan, rows, cols)


_DUO_CACHE: dict = {}


def duo_retrieval_heads(policy: PluginPolicy, vllm_config, local_kv_heads: int) -> torch.Tensor:
    """duo: ``[layers, local_kv_heads]`` bool (True: retrieval head) for this rank's KV heads.

    The pattern is kvkit's (``kvkit.policies.duo``: the shipped one for the model, or ``policy.pattern``), binarised
    with the same sparsity default as ``kvkit.patch(model, "duo")``. Tensor parallelism: vLLM gives rank ``r`` the KV
    heads ``[r * H / tp, (r + 1) * H / tp)``, or, with fewer KV heads than ranks, replicates head ``r // (tp / H)``.
    """

    if vllm_config is None:
        raise RuntimeError("kvkit.vllm duo: no vLLM config in this context (the model config gives the pattern)")
    hf = vllm_config.model_config.hf_config
    tc = vllm_config.model_config.hf_text_config
    total = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    key = (policy, id(hf))
    if key not in _DUO_CACHE:
        duo = policy.kvkit_policy  # the pattern read and checked when the switch was parsed
        try:
            _DUO_CACHE[key] = duo.retrieval_heads(hf)
        except ValueError as e:
            raise ValueError(f"kvkit.vllm: {e}") from None
    full = _DUO_CACHE[key]
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    if total >= tp:
        if local_kv_heads * tp != total:
            raise ValueError(f"kvkit.vllm duo: {local_kv_heads} KV heads per rank x TP {tp} != {total} KV heads")
        heads = list(range(rank * local_kv_heads, (rank + 1) * local_kv_heads))
    else:
        heads = [rank // (tp // total)]
    return full[:, heads].clone()


class KvkitCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return KvkitCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return KvkitCPUAttentionMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        cfg = get_current_vllm_config_or_none()
        policy = policy_from(cfg) if cfg is not None else _last_policy
        if policy is not None and policy.name == "quant" and isinstance(spec, FullAttentionSpec):
            if type(spec) is not FullAttentionSpec:
                raise ValueError(f"kvkit.vllm quant: {type(spec).__name__} layers are not supported")
            from kvkit.vllm.quant import quant_spec

            return quant_spec(spec, policy)
        if policy is None or policy.name != "streaming" or not policy.free or type(spec) is not FullAttentionSpec:
            return spec
        from kvkit.vllm.spec import KvkitStreamingSpec

        bs = spec.block_size
        return KvkitStreamingSpec.from_spec(spec, policy.sink_blocks(bs), policy.recent_blocks(bs))
