"""One layer's decode attention: kvkit's per-(row, KV head) kernel against vLLM's own CPU op, on the same bf16 pages.

    .venv-vllm/bin/python benchmarks/vllm/bench_paged_heads_kernel.py --rows 4 --tokens 4096 --threads 1

Same rows, pages (written by vLLM's ``cpu_attn_reshape_and_cache`` in the ISA vLLM picks: AMX on this machine) and
query. Timed (median of ``--reps`` calls each):

* ``vllm_full``: vLLM's ``cpu_attention_with_kv_cache`` over every block (vanilla decode);
* ``vllm_streaming``: vLLM's op over a table reduced to sink + recent blocks (what a layer whose heads all stream
  runs under ``duo``);
* ``kvkit_full``: the per-head kernel with every head reading every block (the kernel's own speed at vanilla reads;
  called as the engine calls it, :func:`kvkit.kernels.paged_heads_cpu.decode_rows`: bf16 in and out, in place);
* ``kvkit_duo_R``: the kernel with R of the KV heads retrieval (every block), the others streaming (sink + recent
  blocks): what a layer mixing both kinds runs under ``duo``.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvkit.kernels import paged_heads_cpu as PH

    H, G, D, bs, n, L = a.kv_heads, a.group, a.head_dim, a.block, a.rows, a.tokens
    nb = -(-L // bs)
    NB = n * nb + 4
    g = torch.Generator().manual_seed(0)
    bt = torch.randperm(NB, generator=g)[: n * nb].view(n, nb).to(torch.int32)
    seq = torch.full((n,), L, dtype=torch.int32)
    q = torch.randn(n, H * G, D, generator=g).bfloat16()
    isa = _get_attn_isa(torch.bfloat16, bs, D, "auto")
    if isa == "amx":
        torch.cpu._init_amx()
    layout = PH.layout_for_isa(isa)
    kv_cache = torch.zeros(NB, H, bs, 2 * D, dtype=torch.bfloat16)
    kc, vc = PH.split_cache(kv_cache)
    pos = torch.arange(L)
    for i in range(n):
        k, v = torch.randn(L, H, D, generator=g).bfloat16(), torch.randn(L, H, D, generator=g).bfloat16()
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, bt[i].long()[pos // bs] * bs + pos % bs, isa)
    S = -(-a.sink // bs) if a.sink else 0
    first = max(S, max(0, L - a.recent) // bs)
    cols = list(range(S)) + list(range(first, nb))
    s_tbl = torch.zeros_like(bt)
    s_tbl[:, : len(cols)] = bt[:, cols]
    s_seq = torch.full((n,), (len(cols) - 1) * bs + (L - (nb - 1) * bs), dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    out = torch.empty(n, H * G, D, dtype=torch.bfloat16)
    kout = torch.empty(n, H * G, D, dtype=torch.bfloat16)
    tok = torch.arange(n)

    def vllm_op(table, lens):
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=n, num_heads=H * G, num_kv_heads=H, head_dim=D, seq_lens=lens, dtype=torch.bfloat16,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
            dynamic_causal=None, kv_cache_dtype="auto")

        def run():
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=lens,
                scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
                scheduler_metadata=sched, s_aux=None)
        return run

    res = {"rows": n, "tokens": L, "kv_heads": H, "group": G, "head_dim": D, "block": bs, "threads": a.threads,
           "isa": isa, "kernel_available": PH.available(), "sink": a.sink, "recent": a.recent,
           "streaming_blocks": len(cols), "blocks": nb}
    res["vllm_full_ms"] = round(timed(vllm_op(bt, seq), a.reps), 3)
    res["vllm_streaming_ms"] = round(timed(vllm_op(s_tbl, s_seq), a.reps), 3)
    for R in range(H, -1, -1):
        ret = torch.tensor([h < R for h in range(H)])
        blocks = torch.where(ret.view(1, H, 1), bt.unsqueeze(1), s_tbl.unsqueeze(1)).contiguous()
        ntok = torch.where(ret.view(1, H), seq.unsqueeze(1), s_seq.unsqueeze(1)).contiguous()
        name = "kvkit_full_ms" if R == H else f"kvkit_duo_{R}of{H}_retrieval_ms"
        # the engine's call: bf16 query rows read and bf16 output rows written in place
        res[name] = round(timed(lambda: PH.decode_rows(q, tok, kc, vc, blocks, ntok, D ** -0.5, layout, kout),
                                a.reps), 3)
    # the kernel's output against vLLM's at full reads (bf16 output rounding; AMX also rounds probabilities)
    blocks = bt.unsqueeze(1).expand(n, H, nb).contiguous()
    ntok = seq.unsqueeze(1).expand(n, H).contiguous()
    vllm_op(bt, seq)()
    mine = PH.decode(q, kc, vc, blocks, ntok, D ** -0.5, layout)
    res["max_rel_diff_vs_vllm"] = float(((out.float() - mine).abs().max() / mine.abs().max()).item())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
