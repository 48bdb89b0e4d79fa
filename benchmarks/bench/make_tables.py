"""Markdown tables and the "decode throughput vs batch" figure from `kvkit bench --batch` runs.

    python benchmarks/bench/make_tables.py --after results/speed-cpu/decode-b8x4096-2026-11-26 \
        --small-after results/speed-cpu/decode-b1x1024-2026-11-26 \
        --memory results/speed-cpu/decode-fit-4gib-b8x4096-2026-11-24 [--figure throughput_vs_batch.png]

`--after` / `--small-after` are the runs reported (a KV-dominated shape such as 8 x 4096, and a small one such as
1 x 1024); `--before` / `--small-before` optionally add a second run of the same command (another commit or
machine) as side-by-side columns. Prints, per thread count, each policy's speed-up over full, byte bound and
fraction of the bound, against these goals: large shape, speed-up >= 1 + 0.7 (bound - 1); small shape, speed-up
>= 0.9; --memory, fits >= 0.9 x (full's bytes / the policy's) as many sequences as full, and more throughput.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(d):
    """A run's summary.json, or its partial.json (rows so far) when the run did not finish."""
    if d is None:
        return None
    p = Path(d)
    if p.is_dir():
        p = p / "summary.json" if (p / "summary.json").exists() else p / "partial.json"
    if not p.exists():
        return None
    s = json.loads(p.read_text())
    rows = s.get("rows", [])
    if s.get("partial") and rows and not any(r["label"] == "full" for r in rows):
        for t in {r["threads"] for r in rows}:  # a partial run has no full row yet: rebuild it from the pairs
            r0 = next(r for r in rows if r["threads"] == t)
            rows.append(dict(label="full", threads=t, batch=r0["batch"], length=r0["length"], step_ms=r0["full_step_ms"],
                             cpu_ms=None, speedup=1.0, bound=1.0, kv_held_vs_full=1.0, kv_read_vs_full=1.0))
    return s


def f2(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def rows_by(s, t):
    return {r["label"]: r for r in s["rows"] if r["threads"] == t}


def _cell(x, key="speedup", frac="fraction"):
    if not x or x.get(key) is None:
        return "-"
    return f"{x[key]:.2f}" + (f" ({x[frac]:.2f})" if x.get(frac) is not None else "")


def _meets(x, tgt, key):
    if not x or x.get(key) is None:
        return "-"
    return "yes" if x[key] >= tgt else f"no ({x[key] / tgt - 1:+.0%})"


def target_table(before, after, threads):
    """Per policy: bytes, byte bound, goal speed-up and the measured speed-ups (the --before run's when given)."""
    out = []
    b, a = rows_by(before, threads) if before else {}, rows_by(after, threads) if after else {}
    ref = a or b
    labels = [lab for lab in dict.fromkeys(list(a) + list(b)) if lab != "full"]
    any_row = ref[labels[0]] if labels else ref["full"]

    def step(d):
        return f"{d['full']['step_ms']:.0f}" if d.get("full") else "-"

    def cpu(d):
        return f"{d['full']['cpu_ms']:.0f}" if d.get("full") and d["full"].get("cpu_ms") else "-"

    head = f"**{any_row['batch']} x {any_row['length']}, {threads} thread(s)** - full's median step: "
    out.append(head + (f"--before {step(b)} ms wall, " if b else "") + f"{step(a)} ms wall / {cpu(a)} ms CPU time\n")
    cols = ["policy", "KV held vs full", "read/step vs full", "byte bound", "goal speed-up"]
    cols += ["--before: speed-up, wall (fraction)"] if b else []
    cols += ["speed-up, wall (fraction)", "speed-up, CPU time (fraction)", "meets the goal (wall / CPU time)"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "---|" * len(cols))
    for lab in labels:
        r = a.get(lab) or b.get(lab)
        bound = r["bound"]
        tgt = 1 + 0.7 * (bound - 1) if bound >= 1.01 else None
        ra = a.get(lab)
        if tgt is None:
            meet = "(reads as much as full: no bound)"
        else:
            meet = f"{_meets(ra, tgt, 'speedup')} / {_meets(ra, tgt, 'cpu_speedup')}"
        cells = [lab, f2(r["kv_held_vs_full"]), f2(r["kv_read_vs_full"]), f2(bound), f2(tgt)]
        cells += [_cell(b.get(lab))] if b else []
        cells += [_cell(ra), _cell(ra, "cpu_speedup", "cpu_fraction"), meet]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def small_table(before, after, threads):
    """Per policy: the speed-up over full, wall and CPU time (the --small-before run's when given), goal >= 0.9."""
    b, a = rows_by(before, threads) if before else {}, rows_by(after, threads) if after else {}
    ref = a or b

    def step(d, k="step_ms"):
        return f"{d['full'][k]:.0f}" if d.get("full") and d["full"].get(k) else "-"

    head = f"**{ref['full']['batch']} x {ref['full']['length']}, {threads} thread(s)** - full's median step: "
    cols = ["policy"] + (["--before: speed-up wall", "--before: CPU time"] if b else [])
    cols += ["speed-up wall", "speed-up CPU time", "goal >= 0.90 (wall / CPU time)"]
    out = [head + (f"--before {step(b)} ms wall / {step(b, 'cpu_ms')} ms CPU, " if b else "")
           + f"{step(a)} ms wall / {step(a, 'cpu_ms')} ms CPU\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for lab in dict.fromkeys(list(a) + list(b)):
        if lab == "full":
            continue
        ra, rb = a.get(lab), b.get(lab)
        cells = [lab] + ([_cell(rb, "speedup", None), _cell(rb, "cpu_speedup", None)] if b else [])
        cells += [_cell(ra, "speedup", None), _cell(ra, "cpu_speedup", None),
                  f"{_meets(ra, 0.9, 'speedup')} / {_meets(ra, 0.9, 'cpu_speedup')}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def memory_table(mem):
    fits = {f["label"]: f for f in mem["fits"]}
    out = [f"**--memory {mem['memory_gib']} GiB, context {mem['length']}** (decode headroom {mem['headroom_tokens']} "
           f"tokens per sequence; measured at min(fit, --max-batch {mem['max_batch']}))\n",
           "| policy | KV held / seq | full's bytes / policy's | fits | fits vs full | goal >= 0.9 x bytes ratio | "
           "meets | measured batch | tok/s (full's at its batch, same rounds) | throughput vs full |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for lab, f in fits.items():
        rs = [r for r in mem["memory"] if r["label"] == lab and not r.get("paired_with")]
        if lab == "full":
            out.append(f"| full | {f['kv_held_per_seq'] / 2**20:.1f} MiB | 1.00 | {f['fit_batch']} | 1.00 | - | - | "
                       f"{f['measured_batch']} | - | - |")
            continue
        tgt = 0.9 * f["held_ratio"]
        meet = "yes" if f["fit_vs_full"] >= tgt else f"no ({f['fit_vs_full'] / tgt - 1:+.0%})"
        tok = "; ".join(f"{r['tok_s']:.1f} ({r['full_tok_s']:.1f}) @{r['threads']}t" for r in rs)
        thr = "; ".join(f"{r['throughput_vs_full']:.2f}" for r in rs)
        out.append(f"| {lab} | {f['kv_held_per_seq'] / 2**20:.1f} MiB | {f['held_ratio']:.2f} | {f['fit_batch']} | "
                   f"{f['fit_vs_full']:.2f} | {tgt:.2f} | {meet} | {f['measured_batch']} | {tok} | {thr} |")
    return "\n".join(out) + "\n"


def profile_table(before, after, top=4):
    """Per policy: self CPU ms per profiled step and its top ops (the --before run's column when given)."""
    pb, pa = (before or {}).get("profile", {}), (after or {}).get("profile", {})
    cols = ["policy"] + ([f"--before: self CPU ms per step, top {top} ops (% of it)"] if pb else [])
    cols += [f"self CPU ms per step, top {top} ops (% of it)"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def cell(p):
        if not p:
            return "-"
        return f"{p['profiled_self_ms']:.0f} ms CPU: " + "; ".join(f"{o['name'].replace('aten::', '')} {o['pct']:.0f}%"
                                                      for o in p["ops"][:top])

    for lab in dict.fromkeys(list(pb) + list(pa)):
        out.append("| " + " | ".join([lab] + ([cell(pb.get(lab))] if pb else []) + [cell(pa.get(lab))]) + " |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before")
    ap.add_argument("--after")
    ap.add_argument("--small-before")
    ap.add_argument("--small-after")
    ap.add_argument("--memory", action="append", default=[])
    ap.add_argument("--figure", default=None)
    ap.add_argument("--figure-runs", nargs="*", default=None, help="runs for the figure (default --after, --memory)")
    args = ap.parse_args()
    before, after = load(args.before), load(args.after)
    sb, sa = load(args.small_before), load(args.small_after)
    md = []
    for s, name in ((before, "--before"), (after, "--after"), (sb, "--small-before"), (sa, "--small-after")):
        if s:
            md.append(f"- {name}: commit `{(s.get('git_commit') or '?')[:10]}`, `{s.get('command')}`")
    md.append("")
    ref = after or before
    if ref:
        for t in ref["threads"]:
            md.append(target_table(before, after, t))
    ref = sa or sb
    if ref:
        for t in ref["threads"]:
            md.append(small_table(sb, sa, t))
    for m in args.memory:
        md.append(memory_table(load(m)))
    if (before or after) and (before or after).get("profile"):
        md.append(f"Profile, {ref and (after or before)['batch']} x {(after or before)['length']}:\n")
        md.append(profile_table(before, after))
    if sb or sa:
        md.append(f"Profile, {(sa or sb)['batch']} x {(sa or sb)['length']}:\n")
        md.append(profile_table(sb, sa))
    print("\n".join(md))
    if args.figure:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from kvkit.evals.bench import throughput_figure

        runs = [load(d) for d in (args.figure_runs or ([args.after or args.before] + args.memory))]
        png = throughput_figure(runs, title="decode throughput vs batch, default model fp32, CPU, context 4096")
        if png:
            Path(args.figure).write_bytes(png)
            print(f"\nwrote {args.figure}")


if __name__ == "__main__":
    main()
