"""One layer's decode attention: kvkit's packed-page kernel against vLLM's own CPU op on bf16 pages.

    .venv-vllm/bin/python benchmarks/vllm/bench_paged_quant_kernel.py --rows 4 --tokens 4096 --threads 1

Same rows, block tables, sequence lengths and query; kvkit reads ``quant:bits=B`` pages
(:func:`kvkit.kernels.paged_quant_cpu.decode`), vLLM reads bf16 pages (``ops.cpu_attention_with_kv_cache``,
the ISA vLLM picks: AMX on this machine). Median of ``--reps`` calls each. Prints one JSON line.
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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvkit.kernels import paged_quant_cpu as PQ

    H, G, D, bs, n, L = a.kv_heads, a.group, a.head_dim, a.block, a.rows, a.tokens
    nb = -(-L // bs)
    NB = n * nb + 4
    g = torch.Generator().manual_seed(0)
    bt = torch.randperm(NB, generator=g)[: n * nb].view(n, nb).to(torch.int32)
    seq = torch.full((n,), L, dtype=torch.int32)
    q = torch.randn(n, H * G, D, generator=g).bfloat16()
    kv = [(torch.randn(L, H, D, generator=g).bfloat16(), torch.randn(L, H, D, generator=g).bfloat16())
          for _ in range(n)]
    pos = torch.arange(L)
    slots = [bt[i].long()[pos // bs] * bs + pos % bs for i in range(n)]
    res = {"rows": n, "tokens": L, "kv_heads": H, "group": G, "head_dim": D, "block": bs, "threads": a.threads,
           "kernel_available": PQ.available()}
    for bits in (4, 8):
        cache = torch.zeros(NB, H, bs, PQ.state_bytes(D, bits, bs), dtype=torch.uint8)
        for i in range(n):
            PQ.write(cache, kv[i][0], kv[i][1], slots[i], bs, bits)
        res[f"kvkit_{bits}bit_ms"] = round(timed(lambda: PQ.decode(q, cache, bt, seq, bs, bits, D ** -0.5), a.reps), 3)
    isa = _get_attn_isa(torch.bfloat16, bs, D, "auto")
    if isa == "amx":
        torch.cpu._init_amx()
    pages = torch.zeros(NB, H, 2 * bs, D, dtype=torch.bfloat16)
    kc, vc = pages.chunk(2, dim=2)
    for i in range(n):
        ops.cpu_attn_reshape_and_cache(kv[i][0], kv[i][1], kc, vc, slots[i], isa)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=H * G, num_kv_heads=H, head_dim=D, seq_lens=seq, dtype=torch.bfloat16,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    out = torch.empty(n, H * G, D, dtype=torch.bfloat16)

    def vllm_op():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=seq, scale=D ** -0.5,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0, scheduler_metadata=sched,
            s_aux=None)

    res[f"vllm_bf16_{isa}_ms"] = round(timed(vllm_op, a.reps), 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
