"""Where a decode step's time goes, per policy, with torch.profiler: eager steps, or compiled ones (``--compiled``).

For each policy on a random-weight model of ``--shape``: prefill ``--batch x --length`` tokens, ``--warmup`` untimed
steps (after the compile with ``--compiled``), then ``--steps`` steps under ``torch.profiler`` (CPU + CUDA
activities); the policies left after ``--time-limit`` seconds are skipped. Writes the same text to ``--out`` (a
file, rewritten after every line: a run cut short still leaves what it measured).

Eager (the default; kvkit's default GPU options of :mod:`kvkit.evals.gpu`, every policy unless ``--policies``). Per
policy:

* ``wall ms``: host wall time per step (synchronised at the end of the profiled block),
* ``gpu ms``: summed device-kernel time per step (the kernels' own durations, no gaps),
* ``launches``: device kernels launched per step,
* ``busy``: gpu ms / wall ms (near 1: the device is the bottleneck; far below: the host is),

then the operators with the most device time and the most host time (self), so a slow row says whether it is slow
because it moves bytes or because the host cannot feed the GPU.

``--compiled`` (kvkit's ``<policy> static+compile`` rows of :mod:`kvkit.evals.gpu`: static cache, the single-token
step through ``model.get_compiled_call``, CUDA graphs on CUDA; full, streaming and snapkv unless ``--policies``).
Per policy:

* ``wall ms``: host wall time per step (synchronised at the end of the profiled block);
* ``kernels``: device activities per step as the profiler records them (the kernels inside a CUDA-graph replay
  when CUPTI traces graph nodes, as recent drivers do; not checked on a GPU yet: a count near ``graph replays``
  would mean the replays were recorded whole);
* ``busy ms``: the union of the kernels' intervals per step; ``gaps ms``: the time between consecutive kernels of a
  step (first kernel start to last kernel end, less ``busy``), and the median gap in microseconds;
* ``graph replays``: ``cudaGraphLaunch`` calls per step (1: the whole step is one CUDA graph);
* ``first-to-last ms``: the device span of a step's kernels; ``host ms``: wall less that span (the step wrapper,
  the argmax, the launch);

then the kernels with the most device time.

    python benchmarks/gpu/profile_step.py --shape llama-3.2-1b --device cuda --batch 16 --length 16384 \\
        --policies full snapkv duo --out $OUT/profile.txt
    python benchmarks/gpu/profile_step.py --compiled --shape llama-3.2-1b --device cuda --batch 16 --length 16384 \\
        --policies full streaming snapkv --out $OUT/profile.txt
CPU checks of the script itself (no device events; the host side only): ``--shape tiny --device cpu --batch 1
--length 512 --steps 2``; ``--compiled --shape tiny --device cpu --batch 1 --length 64 --steps 2
--compile-backend aot_eager``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvkit.evals.gpu import Bench

#: the policies profiled eager by default (every policy)
POLICIES = ["full", "streaming", "snapkv", "tidal", "duo", "cake", "chelsea", "zipcache", "shadowkv", "kvzip"]
#: the policies profiled with ``--compiled`` by default
COMPILED_POLICIES = ["full", "streaming", "snapkv"]


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


def _event_rows(prof, steps: int, cuda: bool):
    """(gpu ms per step, kernel launches per step, top device ops, top host ops) from a finished profile."""
    evs = prof.key_averages()
    dev_total, launches = 0.0, 0
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            dev_total += e.time_range.elapsed_us()
            launches += 1
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top_dev = sorted(evs, key=lambda e: getattr(e, key, 0.0), reverse=True)[:10] if cuda else []
    top_host = sorted(evs, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return dev_total / 1e3 / steps, launches / steps, top_dev, top_host


def _parse(argv):
    """The command line, with the defaults of the mode (eager, or ``--compiled``) filled in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compiled", action="store_true",
                    help="profile kvkit's static+compile rows (compiled steps, CUDA graphs on CUDA) instead of eager")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before the profile (default 3; "
                    "--compiled: 2, after the compile)")
    ap.add_argument("--policies", nargs="+", default=None,
                    help=f"default: {' '.join(POLICIES)}; --compiled: {' '.join(COMPILED_POLICIES)}")
    ap.add_argument("--compile-backend", default=None, help="--compiled: torch.compile backend (default inductor)")
    ap.add_argument("--time-limit", type=float, default=90.0, help="skip the policies left after this many seconds")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.compile_backend is not None and not a.compiled:
        ap.error("--compile-backend needs --compiled (the eager rows compile nothing)")
    if a.warmup is None:
        a.warmup = 2 if a.compiled else 3
    if a.policies is None:
        a.policies = COMPILED_POLICIES if a.compiled else POLICIES
    if a.compile_backend is None:
        a.compile_backend = "inductor"
    return a


class _Report:
    """The report's lines: printed, and the whole text rewritten to ``path`` (when given) after every line."""

    def __init__(self, path: str | None):
        self.path, self.lines = path, []

    def __call__(self, s: str = "") -> None:
        print(s, flush=True)
        self.lines.append(s)
        if self.path:
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def _eager_report(out, label: str, prof, wall: float, a, cuda: bool, summary: list) -> None:
    """The eager row's lines: wall vs summed kernel time, launches, busy, top device and host operators."""
    gpu, launches, top_dev, top_host = _event_rows(prof, a.steps, cuda)
    summary.append((label, wall, gpu, launches))
    out(f"\n## {label}: wall {wall:.3f} ms/step, gpu {gpu:.3f} ms/step, {launches:.0f} kernels/step, "
        f"busy {gpu / wall:.2f}")
    if top_dev:
        out("device time (self, ms/step): " + "; ".join(
            f"{e.key[:60]} {e.self_device_time_total / 1e3 / a.steps:.3f} (x{e.count / a.steps:.0f})"
            for e in top_dev))
    out("host time (self, ms/step): " + "; ".join(
        f"{e.key[:60]} {e.self_cpu_time_total / 1e3 / a.steps:.3f} (x{e.count / a.steps:.0f})" for e in top_host))


def _compiled_report(out, label: str, prof, wall: float, a, cuda: bool, summary: list, compile_s: float) -> None:
    """The compiled row's lines: kernels, busy time and gaps, graph replays, host time, top device kernels."""
    kernels, launches = [], 0
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end))
        elif e.name in ("cudaGraphLaunch", "cuGraphLaunch"):
            launches += 1
    ks = kernel_stats(kernels, a.steps)
    host = wall - ks["span_ms"]
    summary.append((label, wall, ks, launches / a.steps, host, compile_s))
    gap = "n/a" if ks["median_gap_us"] is None else f"{ks['median_gap_us']:.2f} us"
    out(f"\n## {label}: wall {wall:.3f} ms/step; {ks['kernels']:.0f} kernels/step, busy {ks['busy_ms']:.3f} "
        f"ms, gaps {ks['gaps_ms']:.3f} ms (median {gap}), first-to-last {ks['span_ms']:.3f} ms; "
        f"{launches / a.steps:.1f} graph replays/step; host {host:.3f} ms; compile + warm-up {compile_s:.1f} s")
    if cuda:
        top = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:12]
        out("device time (self, ms/step): " + "; ".join(
            f"{e.key[:70]} {e.self_device_time_total / 1e3 / a.steps:.3f} (x{e.count / a.steps:.0f})"
            for e in top if e.self_device_time_total > 0))


def _summary_table(out, summary: list, compiled: bool) -> None:
    """The closing markdown table of every profiled row."""
    if not compiled:
        out("\n| policy | wall ms/step | gpu ms/step | kernels/step | busy |\n|---|---|---|---|---|")
        for label, wall, gpu, launches in summary:
            out(f"| {label} | {wall:.3f} | {gpu:.3f} | {launches:.0f} | {gpu / wall:.2f} |")
        return
    out("\n| row | wall ms/step | kernels/step | busy ms | gaps ms | median gap | graph replays/step | host ms |\n"
        "|---|---|---|---|---|---|---|---|")
    for label, wall, ks, replays, host, _ in summary:
        gap = "" if ks["median_gap_us"] is None else f"{ks['median_gap_us']:.2f} us"
        out(f"| {label} | {wall:.3f} | {ks['kernels']:.0f} | {ks['busy_ms']:.3f} | {ks['gaps_ms']:.3f} | {gap} | "
            f"{replays:.1f} | {host:.3f} |")


def main(argv=None) -> int:
    """Profile the decode steps of every ``--policies`` row (eager, or ``--compiled``) and print / write the report."""
    a = _parse(argv)
    t0 = time.perf_counter()
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    bench = Bench(a.shape, a.device, dtype, [("full", {})], a.batch, a.length,
                  steps=a.warmup + a.steps + (4 if a.compiled else 2), warmup=a.warmup, compiled=a.compiled, t0=t0,
                  compile_backend=a.compile_backend)
    bench.setup()
    out = _Report(a.out)
    where = f"{a.shape} on {a.device} ({torch.cuda.get_device_name() if cuda else 'cpu'}), batch {a.batch} x {a.length}"
    if a.compiled:
        out(f"# compiled decode-step profile: {where}, {a.steps} profiled steps after the compile and {a.warmup} "
            f"warm-up steps; torch {torch.__version__}, {a.compile_backend}")
    else:
        out(f"# decode-step profile: {where}, {a.steps} profiled steps after {a.warmup} warm-up steps; torch "
            f"{torch.__version__}")
    summary = []
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for name in a.policies:
        if time.perf_counter() - t0 > a.time_limit:
            out(f"\n## {name}{' static+compile' if a.compiled else ''}: skipped (time limit {a.time_limit:.0f} s)")
            continue
        row = bench._make(name, {}, compiled=a.compiled)
        try:
            row.prefill(bench.ids, bench.chunk)
            with row.active():  # eager: the policy patched around its steps; compiled: patched since the prefill
                t = time.perf_counter()
                # compiled: the compile and the CUDA-graph warm-up and recording come before the warm-up steps
                for _ in range(a.warmup + ((2 if row.cudagraphs else 0) + 1 if a.compiled else 0)):
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
        if a.compiled:
            _compiled_report(out, row.label, prof, wall, a, cuda, summary, compile_s)
        else:
            _eager_report(out, row.label, prof, wall, a, cuda, summary)
        row.close()
        del row, prof
        if cuda:
            torch.cuda.empty_cache()
    _summary_table(out, summary, a.compiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
