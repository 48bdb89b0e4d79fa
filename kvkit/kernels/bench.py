"""Benchmark of the decode kernels: ``python -m kvkit.kernels.bench [--n 4096,32768,131072] ...``.

For each kernel and context length N: median time of the dispatched kernel (Triton on CUDA, the torch
reference elsewhere), its effective bandwidth = bytes that must be read (each needed input byte once:
selected K/V rows, packed codes + statistics, index lists) / time, the fraction of the peak memory
bandwidth, the time of the plain torch reference, and the time of dense SDPA decode over all N tokens
(``F.scaled_dot_product_attention`` with ``enable_gqa``) at the same N. On CUDA the timings use
``triton.testing.do_bench`` (median, L2 flushed between runs); on CPU a small wall-clock loop at small
sizes (the table then compares the reference path with SDPA only).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

import kvkit.kernels as K
from kvkit import env

H100_SXM_GBS = 3350.0


def _timer(device, graph=False):
    """Median time in us. CUDA: do_bench (L2 flushed between runs); ``graph=True`` captures the call in a
    CUDA graph and times its replays: device time without Python launch overhead."""
    if device.type == "cuda":
        import triton.testing

        def bench(fn):
            if graph:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()
                    fn()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                fn = g.replay
            return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3

        return bench

    def bench(fn):
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    return bench


def copy_bandwidth(device, nbytes=1 << 30):
    """Measured device-to-device copy bandwidth (bytes read + written / time), GB/s."""
    if device.type != "cuda":
        return float("nan")
    import triton.testing

    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _nb(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def _ref_path(fn):
    """The same call through the torch reference path of the dispatcher."""
    def g():
        with env.override("KVKIT_KERNELS", "reference"):
            return fn()
    return g


def _rows_for_n(args, N, dev, dt, gen, time_ref):
    eager = _timer(dev)
    gbench = _timer(dev, graph=dev.type == "cuda")
    B, Hq, Hkv, D = args.batch, args.hq, args.hkv, args.d
    scale = D**-0.5
    q = torch.randn(B, Hq, D, device=dev, dtype=dt)
    k = torch.randn(B, Hkv, N, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, N, D, device=dev, dtype=dt)
    q4 = q.unsqueeze(2)
    kv_bytes = _nb(k, v)
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    t_sdpa = gbench(sdpa)
    rows = [("dense SDPA (enable_gqa)", N, N, t_sdpa, kv_bytes, eager(sdpa) if dev.type == "cuda" else t_sdpa,
             None, t_sdpa)]

    def add(name, kk, fn, nbytes):
        t = gbench(fn)
        te = eager(fn) if dev.type == "cuda" else t
        tr = eager(_ref_path(fn)) if time_ref else None
        rows.append((name, N, kk, t, nbytes, te, tr, t_sdpa))

    add("weighted_decode (dense, no bias)", N, lambda: K.weighted_decode(q, k, v), kv_bytes)
    lw = torch.randn(B, Hkv, N, device=dev)
    add("weighted_decode (log-weight)", N, lambda: K.weighted_decode(q, k, v, lw), kv_bytes + _nb(lw))
    for kk in sorted({min(args.topk, N), N}):
        idx = torch.stack([torch.randperm(N, generator=gen)[:kk].sort().values for _ in range(B * Hkv)])
        idx = idx.view(B, Hkv, kk).to(dev, torch.int32)
        nbytes = 2 * B * Hkv * kk * D * k.element_size() + _nb(idx)
        add(f"sparse_decode top-{kk}", kk, lambda idx=idx: K.sparse_decode(q, k, v, idx), nbytes)
    for bits in args.bits:
        kp = K.quantize(k, bits, args.kgroup, axis=-2)
        vp = K.quantize(v, bits, None, axis=-1, channel_prescale=True)
        add(f"quant_decode int{bits} (K ch-wise g{args.kgroup}, V tok-wise)", N,
            lambda kp=kp, vp=vp: K.quant_decode(q, kp, vp), K.packed_nbytes(kp) + K.packed_nbytes(vp))
    r, lcs = args.rank, 8
    U = torch.randn(B, N, r, device=dev, dtype=dt) / math.sqrt(r)
    SV = torch.randn(B, Hkv, r, D, device=dev, dtype=dt)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    Cl = max(1, min(args.topk, N) // lcs)
    lids = torch.stack([torch.randperm(-(-N // lcs), generator=gen)[:Cl].sort().values for _ in range(B * Hkv)])
    lids = lids.view(B, Hkv, Cl).to(dev, torch.int32)
    # bytes that must be read: per selected token its U row (per head: each head selects its own chunks) + V row
    add(f"lowrank_decode r{r} {Cl}x{lcs}", Cl * lcs, lambda: K.lowrank_decode(q, U, SV, v, lids, lcs, inv_freq),
        B * Hkv * Cl * lcs * (r + D) * U.element_size() + _nb(SV, lids))
    return rows


def run(args):
    dev = torch.device(args.device)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    triton_on = K.use_triton(torch.empty(0, device=dev))
    rows = []
    for N in args.n:
        rows += _rows_for_n(args, N, dev, dt, gen, time_ref=triton_on and not args.no_ref)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows, "triton" if triton_on else "torch reference"


SWEEP = [(32, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 3), (64, 4, 4), (128, 4, 3)]
SWEEP_LOWRANK = [(16, 4, 2), (32, 4, 2), (64, 8, 2), (32, 8, 3)]


def sweep(args):
    """Time each kernel's (block_n, num_warps, num_stages) candidates at the largest N; keep the fastest
    in the module's TUNING table (used by the following benchmark in the same process)."""
    from . import lowrank, quant_attn, sparse

    dev = torch.device(args.device)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    bench = _timer(dev, graph=True)
    B, Hq, Hkv, D, N = args.batch, args.hq, args.hkv, args.d, max(args.n)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, D, device=dev, dtype=dt)
    k = torch.randn(B, Hkv, N, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, N, D, device=dev, dtype=dt)
    kk = min(args.topk, N)
    idx = torch.stack([torch.randperm(N, generator=gen)[:kk].sort().values for _ in range(B * Hkv)])
    idx = idx.view(B, Hkv, kk).to(dev, torch.int32)
    full = torch.arange(N, device=dev, dtype=torch.int32).expand(B, Hkv, N).contiguous()
    kp = K.quantize(k, 4, args.kgroup, axis=-2)
    vp = K.quantize(v, 4, None, axis=-1, channel_prescale=True)
    r, lcs = args.rank, 8
    U = torch.randn(B, N, r, device=dev, dtype=dt) / math.sqrt(r)
    SV = torch.randn(B, Hkv, r, D, device=dev, dtype=dt)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    lids = torch.stack([torch.randperm(-(-N // lcs), generator=gen)[:kk // lcs].sort().values
                        for _ in range(B * Hkv)]).view(B, Hkv, -1).to(dev, torch.int32)
    cases = [
        ("sparse_decode top-all", sparse.TUNING, SWEEP, lambda: K.sparse_decode(q, k, v, full), _nb(k, v, full)),
        (f"sparse_decode top-{kk}", sparse.TUNING, SWEEP, lambda: K.sparse_decode(q, k, v, idx),
         2 * B * Hkv * kk * D * k.element_size() + _nb(idx)),
        ("quant_decode int4", quant_attn.TUNING, SWEEP, lambda: K.quant_decode(q, kp, vp),
         K.packed_nbytes(kp) + K.packed_nbytes(vp)),
        ("lowrank_decode", lowrank.TUNING, SWEEP_LOWRANK, lambda: K.lowrank_decode(q, U, SV, v, lids, lcs, inv_freq),
         B * Hkv * kk * (r + D) * U.element_size()),
    ]
    lines = [f"sweep at N={N} (B={B} Hq={Hq} Hkv={Hkv} D={D}): time us (GB/s) per (block_n, num_warps, num_stages)"]
    best = {}
    for name, tun, configs, fn, nbytes in cases:
        res = []
        for cfg in configs:
            tun.update(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
            try:
                t = bench(fn)
            except Exception as e:  # a config that does not compile / fit shared memory
                lines.append(f"  {name} {cfg}: failed ({type(e).__name__})")
                continue
            res.append((t, cfg))
            lines.append(f"  {name} {cfg}: {t:.1f} us ({nbytes / (t * 1e-6) / 1e9:.0f} GB/s)")
        t, cfg = min(res)
        # one table per module: the first case of a module (the bandwidth-bound one) decides
        if id(tun) not in best:
            best[id(tun)] = (tun, cfg)
        lines.append(f"  -> best {name}: {cfg} {t:.1f} us")
    for tun, cfg in best.values():
        tun.update(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
    lines.append(f"chosen: sparse {sparse.TUNING}, quant {quant_attn.TUNING}, lowrank {lowrank.TUNING}")
    return "\n".join(lines)


def table(rows, path, peak, copy_gbs, device_name, args):
    out = [f"device: {device_name}; kernel path: {path}; dtype {args.dtype}; B={args.batch} Hq={args.hq} "
           f"Hkv={args.hkv} D={args.d}",
           f"peak bandwidth used for %: {peak:.0f} GB/s ({args.peak_src})" + (f"; measured D2D copy: {copy_gbs:.0f} GB/s"
                                                            if copy_gbs == copy_gbs else ""),
           "",
           "time = device time of one call (CUDA: median of CUDA-graph replays, L2 flushed; CPU: wall clock);"
           " GB/s = bytes that must be read / time; eager = the same call from Python (launch overhead"
           " included); torch ref = the reference path, eager; x vs SDPA = SDPA time / kernel time (both graph).",
           "",
           "| kernel | N | tokens read | time (us) | GB/s | % peak | eager (us) | torch ref (us) | x vs ref (eager) "
           "| dense SDPA (us) | x vs SDPA |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, N, kk, t, nbytes, te, tr, ts in rows:
        gbs = nbytes / (t * 1e-6) / 1e9
        ref = f"{tr:.1f} | {tr / te:.1f}" if tr else "- | -"
        out.append(f"| {name} | {N} | {kk} | {t:.1f} | {gbs:.3g} | {100 * gbs / peak:.0f}% | {te:.1f} | {ref} | "
                   f"{ts:.1f} | {ts / t:.1f} |")
    return "\n".join(out)


def main(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m kvkit.kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--n", default="4096,32768,131072" if cuda else "1024,4096",
                   type=lambda s: [int(x) for x in s.split(",")], help="context lengths")
    p.add_argument("--batch", type=int, default=4 if cuda else 1)
    p.add_argument("--hq", type=int, default=32 if cuda else 8)
    p.add_argument("--hkv", type=int, default=8 if cuda else 2)
    p.add_argument("--d", type=int, default=128 if cuda else 64)
    p.add_argument("--dtype", default="bf16" if cuda else "fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--topk", type=int, default=2048 if cuda else 256, help="selected tokens (sparse, lowrank)")
    p.add_argument("--bits", default="8,4,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--kgroup", type=int, default=128, help="key quantisation group (tokens)")
    p.add_argument("--rank", type=int, default=160)
    p.add_argument("--peak-gbs", type=float, default=None,
                   help="peak memory bandwidth for the %% column (default: H100 SXM 3350 GB/s on CUDA)")
    p.add_argument("--no-ref", action="store_true", help="skip timing the torch reference on CUDA")
    p.add_argument("--sweep", action="store_true", help="first pick block sizes / warps / stages per kernel")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    copy_gbs = copy_bandwidth(dev)
    peak = args.peak_gbs or (H100_SXM_GBS if dev.type == "cuda" else 50.0)
    args.peak_src = ("--peak-gbs" if args.peak_gbs else "H100 SXM datasheet" if dev.type == "cuda"
                     else "a nominal CPU figure; pass --peak-gbs")
    sw = ""
    if args.sweep and K.use_triton(torch.empty(0, device=dev)):
        sw = sweep(args)
        print(sw, flush=True)
        torch.cuda.empty_cache()
    rows, path = run(args)
    txt = table(rows, path, peak, copy_gbs, name, args)
    if sw:
        txt += "\n\n```\n" + sw + "\n```"
    print(txt)
    if args.out:
        with open(args.out, "w") as f:
            f.write(txt + "\n")


if __name__ == "__main__":
    main()
