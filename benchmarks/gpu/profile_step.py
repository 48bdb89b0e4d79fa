"""Where a decode step's time goes, per policy: host (Python + launches) vs device (kernels), with torch.profiler.

For each policy (eager, kvkit's default GPU options of :mod:`kvkit.evals.gpu`) on a random-weight model of
``--shape``: prefill ``--batch x --length`` tokens, ``--warmup`` untimed steps, then ``--steps`` steps under
``torch.profiler`` (CPU + CUDA activities). Per policy it prints

* ``wall ms``: host wall time per step (synchronised at the end of the profiled block),
* ``gpu ms``: summed device-kernel time per step (the kernels' own durations, no gaps),
* ``launches``: device kernels launched per step,
* ``busy``: gpu ms / wall ms (near 1: the device is the bottleneck; far below: the host is),

then the operators with the most device time and the most host time (self), so a slow row says whether it is slow
because it moves bytes or because the host cannot feed the GPU. Writes the same text to ``--out`` (a file).

  python benchmarks/gpu/profile_step.py --shape llama-3.2-1b --device cuda --batch 16 --length 16384 \\
      --policies full snapkv duo --out $OUT/profile.txt
A CPU check of the script itself: ``--shape tiny --device cpu --batch 1 --length 512 --steps 2``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvkit.evals.gpu import Bench

POLICIES = ["full", "streaming", "snapkv", "tidal", "duo", "cake", "chelsea", "zipcache", "shadowkv", "kvzip"]


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--time-limit", type=float, default=90.0, help="skip the policies left after this many seconds")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    bench = Bench(a.shape, a.device, dtype, [("full", {})], a.batch, a.length, steps=a.warmup + a.steps + 2,
                  warmup=a.warmup, compiled=False, t0=t0)
    bench.setup()
    lines: list[str] = []

    def out(s=""):
        print(s, flush=True)
        lines.append(s)
        if a.out:  # rewritten after every line: a run cut short still leaves what it measured
            with open(a.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    out(f"# decode-step profile: {a.shape} on {a.device} ({torch.cuda.get_device_name() if cuda else 'cpu'}), "
        f"batch {a.batch} x {a.length}, {a.steps} profiled steps after {a.warmup} warm-up steps; torch "
        f"{torch.__version__}")
    summary = []
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for name in a.policies:
        if time.perf_counter() - t0 > a.time_limit:
            out(f"\n## {name}: skipped (time limit {a.time_limit:.0f} s)")
            continue
        row = bench._make(name, {})
        try:
            row.prefill(bench.ids, bench.chunk)
            with row.active():
                for _ in range(a.warmup):
                    row.step()
                if cuda:
                    torch.cuda.synchronize()
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
        gpu, launches, top_dev, top_host = _event_rows(prof, a.steps, cuda)
        summary.append((row.label, wall, gpu, launches))
        out(f"\n## {row.label}: wall {wall:.3f} ms/step, gpu {gpu:.3f} ms/step, {launches:.0f} kernels/step, "
            f"busy {gpu / wall:.2f}")
        if top_dev:
            out("device time (self, ms/step): " + "; ".join(
                f"{e.key[:60]} {e.self_device_time_total / 1e3 / a.steps:.3f} (x{e.count / a.steps:.0f})"
                for e in top_dev))
        out("host time (self, ms/step): " + "; ".join(
            f"{e.key[:60]} {e.self_cpu_time_total / 1e3 / a.steps:.3f} (x{e.count / a.steps:.0f})" for e in top_host))
        row.close()
        del row, prof
        if cuda:
            torch.cuda.empty_cache()
    out("\n| policy | wall ms/step | gpu ms/step | kernels/step | busy |\n|---|---|---|---|---|")
    for label, wall, gpu, launches in summary:
        out(f"| {label} | {wall:.3f} | {gpu:.3f} | {launches:.0f} | {gpu / wall:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
