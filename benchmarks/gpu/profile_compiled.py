"""Where a *compiled* decode step's time goes, per policy: torch.profiler over ``static+compile`` steps.

For each policy (kvkit's ``<policy> static+compile`` row of :mod:`kvkit.evals.gpu`: static cache, the single-token
step through ``model.get_compiled_call``, CUDA graphs on CUDA): prefill ``--batch x --length`` tokens, compile and
warm up, then ``--steps`` steps under ``torch.profiler`` (CPU + CUDA activities). Per policy:

* ``wall ms``: host wall time per step (synchronised at the end of the profiled block);
* ``kernels``: device activities per step as the profiler records them (the kernels inside a CUDA-graph replay
  when CUPTI traces graph nodes, as recent drivers do; not checked on a GPU yet: a count near ``graph replays``
  would mean the replays were recorded whole);
* ``busy ms``: the union of the kernels' intervals per step; ``gaps ms``: the time between consecutive kernels of a
  step (first kernel start to last kernel end, less ``busy``), and the median gap in microseconds;
* ``graph replays``: ``cudaGraphLaunch`` calls per step (1: the whole step is one CUDA graph);
* ``first-to-last ms``: the device span of a step's kernels; ``host ms``: wall less that span (the step wrapper,
  the argmax, the launch);

then the kernels with the most device time. Writes the same text to ``--out``.

    python benchmarks/gpu/profile_compiled.py --shape llama-3.2-1b --device cuda --batch 16 --length 16384 \\
        --policies full streaming snapkv --out $OUT/profile.txt
A CPU check (no device events; the host side only): ``--shape tiny --device cpu --batch 1 --length 64 --steps 2
--compile-backend aot_eager``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvkit.evals.gpu import Bench


def kernel_stats(intervals: list[tuple[float, float]], steps: int) -> dict:
    """Per step: kernels, busy (the union of ``[start, end]`` intervals, us), the span first start to last end and
    the gaps between consecutive kernels (sorted by start), from the kernel intervals of ``steps`` steps."""
    if not intervals:
        return dict(kernels=0.0, busy_ms=0.0, span_ms=0.0, gaps_ms=0.0, median_gap_us=None)
    iv = sorted(intervals)
    busy, gaps, cur_s, cur_e = 0.0, [], iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = iv[-1][1] - iv[0][0]
    # the gaps between steps (the host's work between two steps) are left out: the largest steps - 1 gaps
    inner = sorted(gaps)[:max(0, len(gaps) - (steps - 1))]
    return dict(kernels=len(iv) / steps, busy_ms=busy / 1e3 / steps, span_ms=span / 1e3 / steps,
                gaps_ms=sum(inner) / 1e3 / steps, median_gap_us=statistics.median(inner) if inner else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=["full", "streaming", "snapkv"])
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--time-limit", type=float, default=90.0, help="skip the policies left after this many seconds")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    bench = Bench(a.shape, a.device, dtype, [("full", {})], a.batch, a.length, steps=a.warmup + a.steps + 4,
                  warmup=a.warmup, compiled=True, t0=t0, compile_backend=a.compile_backend)
    bench.setup()
    lines: list[str] = []

    def out(s=""):
        print(s, flush=True)
        lines.append(s)
        if a.out:  # rewritten after every line: a run cut short still leaves what it measured
            with open(a.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    out(f"# compiled decode-step profile: {a.shape} on {a.device} "
        f"({torch.cuda.get_device_name() if cuda else 'cpu'}), batch {a.batch} x {a.length}, {a.steps} profiled "
        f"steps after the compile and {a.warmup} warm-up steps; torch {torch.__version__}, {a.compile_backend}")
    summary = []
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for name in a.policies:
        if time.perf_counter() - t0 > a.time_limit:
            out(f"\n## {name} static+compile: skipped (time limit {a.time_limit:.0f} s)")
            continue
        row = bench._make(name, {}, compiled=True)
        try:
            row.prefill(bench.ids, bench.chunk)
            t = time.perf_counter()
            for _ in range(a.warmup + (2 if row.cudagraphs else 0) + 1):  # compile, CUDA-graph record, warm-up
                row.step()
            if cuda:
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t
            with torch.profiler.profile(activities=acts) as prof:
                t = time.perf_counter()
                for _ in range(a.steps):
                    row.step()
                if cuda:
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - t) * 1e3 / a.steps
        except Exception as e:  # noqa: BLE001 -- one policy's failure is a line of the report
            out(f"\n## {row.label}: {type(e).__name__}: {str(e)[:300]}")
            row.close()
            continue
        kernels, launches = [], 0
        for e in prof.events():
            if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
                kernels.append((e.time_range.start, e.time_range.end))
            elif e.name in ("cudaGraphLaunch", "cuGraphLaunch"):
                launches += 1
        ks = kernel_stats(kernels, a.steps)
        host = wall - ks["span_ms"]
        summary.append((row.label, wall, ks, launches / a.steps, host, compile_s))
        gap = "n/a" if ks["median_gap_us"] is None else f"{ks['median_gap_us']:.2f} us"
        out(f"\n## {row.label}: wall {wall:.3f} ms/step; {ks['kernels']:.0f} kernels/step, busy {ks['busy_ms']:.3f} "
            f"ms, gaps {ks['gaps_ms']:.3f} ms (median {gap}), first-to-last {ks['span_ms']:.3f} ms; "
            f"{launches / a.steps:.1f} graph replays/step; host {host:.3f} ms; compile + warm-up {compile_s:.1f} s")
        if cuda:
            top = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:12]
            out("device time (self, ms/step): " + "; ".join(
                f"{e.key[:70]} {e.self_device_time_total / 1e3 / a.steps:.3f} (x{e.count / a.steps:.0f})"
                for e in top if e.self_device_time_total > 0))
        row.close()
        del row, prof
        if cuda:
            torch.cuda.empty_cache()
    out("\n| row | wall ms/step | kernels/step | busy ms | gaps ms | median gap | graph replays/step | host ms |\n"
        "|---|---|---|---|---|---|---|---|")
    for label, wall, ks, replays, host, _ in summary:
        gap = "" if ks["median_gap_us"] is None else f"{ks['median_gap_us']:.2f} us"
        out(f"| {label} | {wall:.3f} | {ks['kernels']:.0f} | {ks['busy_ms']:.3f} | {ks['gaps_ms']:.3f} | {gap} | "
            f"{replays:.1f} | {host:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
