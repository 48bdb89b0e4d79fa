"""Shared scaffold of the one-layer kernel benchmarks (bench_paged_quant_kernel.py, bench_paged_heads_kernel.py)."""

import argparse
import statistics
import time

import torch


def timed(fn, reps):
    """Median wall time of ``fn()`` in ms over ``reps`` calls after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def parser():
    """The layer's shape and the run's options (both benches; each adds its own)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    return ap


def layer(a):
    """Random block tables ``[n, nb]`` (pages shuffled in a pool), sequence lengths ``[n]`` and bf16 queries."""
    H, G, D, bs, n, L = a.kv_heads, a.group, a.head_dim, a.block, a.rows, a.tokens
    nb = -(-L // bs)
    NB = n * nb + 4
    g = torch.Generator().manual_seed(0)
    bt = torch.randperm(NB, generator=g)[: n * nb].view(n, nb).to(torch.int32)
    seq = torch.full((n,), L, dtype=torch.int32)
    q = torch.randn(n, H * G, D, generator=g).bfloat16()
    return g, NB, nb, bt, seq, q
