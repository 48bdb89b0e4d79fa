"""One layer's decode attention: kvkit's packed-page kernel against vLLM's own CPU op on bf16 pages.

    .venv-vllm/bin/python benchmarks/vllm/bench_paged_quant_kernel.py --rows 4 --tokens 4096 --threads 1

Same rows, block tables, sequence lengths and query; kvkit reads ``quant:bits=B`` pages
(:func:`kvkit.kernels.paged_quant_cpu.decode`), vLLM reads bf16 pages (``ops.cpu_attention_with_kv_cache``,
the ISA vLLM picks: AMX on this machine). Median of ``--reps`` calls each. Prints one JSON line.
"""

from __future__ import annotations

import json

import torch
from _kernel_bench import layer, parser, timed


def main():
    ap = parser()
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvkit.kernels import paged_quant_cpu as PQ
    from kvkit.vllm.testing import vllm_decode_op

    H, G, D, bs, n, L = a.kv_heads, a.group, a.head_dim, a.block, a.rows, a.tokens
    g, NB, nb, bt, seq, q = layer(a)
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
        res[f"kvkit_{bits}bit_ms"] = round(timed(lambda cache=cache, bits=bits: PQ.decode(q, cache, bt, seq, bs, bits,
                                                                                 D ** -0.5), a.reps), 3)
    isa = _get_attn_isa(torch.bfloat16, bs, D, "auto")
    if isa == "amx":
        torch.cpu._init_amx()
    pages = torch.zeros(NB, H, 2 * bs, D, dtype=torch.bfloat16)
    kc, vc = pages.chunk(2, dim=2)
    for i in range(n):
        ops.cpu_attn_reshape_and_cache(kv[i][0], kv[i][1], kc, vc, slots[i], isa)
    res[f"vllm_bf16_{isa}_ms"] = round(timed(vllm_decode_op(q, kc, vc, bt, seq, isa), a.reps), 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
