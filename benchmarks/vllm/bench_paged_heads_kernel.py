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

import json

import torch
from _kernel_bench import layer, parser, timed


def main():
    ap = parser()
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvkit.kernels import paged_heads_cpu as PH
    from kvkit.vllm.testing import vllm_decode_op

    H, G, D, bs, n, L = a.kv_heads, a.group, a.head_dim, a.block, a.rows, a.tokens
    g, NB, nb, bt, seq, q = layer(a)
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
    kout = torch.empty(n, H * G, D, dtype=torch.bfloat16)
    tok = torch.arange(n)

    res = {"rows": n, "tokens": L, "kv_heads": H, "group": G, "head_dim": D, "block": bs, "threads": a.threads,
           "isa": isa, "kernel_available": PH.available(), "sink": a.sink, "recent": a.recent,
           "streaming_blocks": len(cols), "blocks": nb}
    res["vllm_full_ms"] = round(timed(vllm_decode_op(q, kc, vc, bt, seq, isa), a.reps), 3)
    res["vllm_streaming_ms"] = round(timed(vllm_decode_op(q, kc, vc, s_tbl, s_seq, isa), a.reps), 3)
    for R in range(H, -1, -1):
        ret = torch.tensor([h < R for h in range(H)])
        blocks = torch.where(ret.view(1, H, 1), bt.unsqueeze(1), s_tbl.unsqueeze(1)).contiguous()
        ntok = torch.where(ret.view(1, H), seq.unsqueeze(1), s_seq.unsqueeze(1)).contiguous()
        name = "kvkit_full_ms" if R == H else f"kvkit_duo_{R}of{H}_retrieval_ms"
        # the engine's call: bf16 query rows read and bf16 output rows written in place
        res[name] = round(timed(lambda blocks=blocks, ntok=ntok: PH.decode_rows(q, tok, kc, vc, blocks, ntok, D ** -0.5, layout,
                                                                          kout),
                                a.reps), 3)
    # the kernel's output against vLLM's at full reads (bf16 output rounding; AMX also rounds probabilities)
    blocks = bt.unsqueeze(1).expand(n, H, nb).contiguous()
    ntok = seq.unsqueeze(1).expand(n, H).contiguous()
    out = vllm_decode_op(q, kc, vc, bt, seq, isa)()
    mine = PH.decode(q, kc, vc, blocks, ntok, D ** -0.5, layout)
    res["max_rel_diff_vs_vllm"] = float(((out.float() - mine).abs().max() / mine.abs().max()).item())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
