"""KV bytes read per decode step by tidal vs full attention, on the default model (or --model).

Prefills an essay prompt of each length, decodes a few tokens, and prints the K/V bytes the last
decode step read (``kvkit.policies.tidal.decode_read_bytes``: every layer's gathered or dense rows x
bytes per row) next to what full attention reads, plus decode tokens/s of both (same run, same
machine). Usage:

    python benchmarks/tidal/measure_reads.py --lengths 2048,4096,8192 --budget 2048 --selection kv_head --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.evals.bench import bench_prompt
from kvkit.models import load
from kvkit.policies.tidal import decode_read_bytes


@torch.no_grad()
def decode(model, ids, steps):
    cache = kvkit.KVCache(model)
    out = model(input_ids=ids, **cache_kw(cache), use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = model(input_ids=nxt, **cache_kw(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return cache, steps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--selection", default="kv_head")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    model, tok = load(a.model, device=a.device)
    print("| length | budget | selection | read MB/step | full MB/step | full/read | tok/s tidal | tok/s full |")
    print("|---|---|---|---|---|---|---|---|")
    for n in [int(x) for x in a.lengths.split(",")]:
        ids = bench_prompt(tok, n).to(model.device)
        kvkit.patch(model, "full")
        _, tps_full = decode(model, ids, a.steps)
        kvkit.patch(model, "tidal", budget=a.budget, selection=a.selection)
        cache, tps = decode(model, ids, a.steps)
        kvkit.unpatch(model)
        r = decode_read_bytes(cache)
        print(f"| {n} | {a.budget} | {a.selection} | {r['read'] / 2**20:.2f} | {r['full'] / 2**20:.2f} | "
              f"{r['ratio']:.2f} | {tps:.1f} | {tps_full:.1f} |", flush=True)


if __name__ == "__main__":
    main()
