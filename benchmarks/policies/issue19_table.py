"""Issue 19 tables: policy x budget on RULER-4K, one table per model, every run scored on the samples it shares with
the full cache, with the paper-setting rows of the calibrated policies on exactly the same samples.

Reads the run folders' samples.jsonl directly (partial runs welcome). Run from anywhere:
    python benchmarks/policies/issue19_table.py                 # default model -> results/policies/issue19.md (+ .csv)
    python benchmarks/policies/issue19_table.py --model qwen05  # Qwen2.5-Coder-0.5B -> results/policies/qwen05/table.md
"""

import argparse
import csv
import json
import pathlib
import statistics
import sys

root = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))
ap = argparse.ArgumentParser()
ap.add_argument("--model", choices=("default", "qwen05"), default="default")
args = ap.parse_args()

# (folder, policy, setting shown, protocol, what the saving is; paper-setting folder to compare on the same samples)
if args.model == "default":
    pol = root / "results" / "policies"
    FULL = root / "results" / "ruler" / "full-4k"
    OUT, TITLE, README_TABLE = pol / "issue19", "default model (SmolLM2-135M-Instruct)", True
    RUNS = [
        ("duo054c200-4k", "duo", "~54% of KV removed, pattern calibrated 200 steps (shipped from session 9 to 32)",
         "agnostic", "bytes", "duo054-4k"),
        ("duo054-4k", "duo", "~54% of KV removed, 12-step pattern (shipped before)", "agnostic", "bytes", None),
        ("duo054d-4k", "duo", "~54% of KV removed, the shipped recipe recalibrated on the disjoint text (session 27 "
         "candidate, not shipped: results/duo/README.md)", "agnostic", "bytes", None),
        ("duo054-4k120", "duo", "~54% of KV removed, recalibrated on 4K samples of the disjoint text, 120 steps (session "
         "29; shipped since session 32: results/duo/README.md)", "agnostic", "bytes", "duo054c200-4k"),
        ("tidalcode1380kv-4k", "tidal", "budget 1380, kv_head, layers [2, 8, 14, 20, 26] (code-needle calibration, rejected: not shipped)",
         "agnostic", "reads", "tidal1732kv-4k"),
        ("tidalsel1537kv-4k", "tidal", "budget 1537, kv_head, layers [2, 6, ..., 26], select_attention=selected "
         "(kvkit: selection layers read every key, only the selected values)", "agnostic", "reads", "tidalrf1132kv-4k"),
        ("tidalrf1132kv-4k", "tidal", "budget 1132, kv_head, layers [2, 6, ..., 26] (read-fraction calibration)", "agnostic", "reads", "tidal1732kv-4k"),
        ("tidalsh1132kv-4k", "tidal", "budget 1132 on average, kv_head, layers [2, 6, ..., 26], calibrated layer shares "
         "(kvkit: per-layer budgets that equalise the captured attention mass; the default)", "agnostic", "reads",
         "tidalrf1132kv-4k"),
        ("tidalrfsum1132kv-4k", "tidal", "budget 1132, kv_head, kv_reduce=sum, layers [2, 6, ..., 26] (stopped early: "
         "52 of its first 57 predictions are the max reduction's)", "agnostic", "reads", "tidalrf1132kv-4k"),
        ("tidalcal1732kv-4k", "tidal", "budget 1732, kv_head, layers [2, 15, 21] (first calibration)",
         "agnostic", "reads", "tidal1732kv-4k"),
        ("zipcachecal-4k", "zipcache", "calibrated bit widths (all 4-bit)", "agnostic", "bytes", "zipcache-4k"),
        ("shadowkvcal1024-4k", "shadowkv", "budget 1024, min_prompt 2048, calibrated rank 120", "agnostic", "bytes",
         "shadowkv1024-4k"),
        ("shadowkvcal2048-4k", "shadowkv", "budget 2048 (the paper's), min_prompt 2048, calibrated rank 120",
         "agnostic", "bytes", None),
        ("cake2048cal-4k", "cake", "budget 2048, calibrated taus (2, 2) and pool kernel 15", "agnostic", "bytes",
         "cake2048-4k"),
        ("cake2048-4k", "cake", "budget 2048, taus (1, 1), kernel 5 (before the calibrations)", "agnostic", "bytes",
         None),
        ("chelsea50-4k", "chelsea", "ratio 0.5, protect 0 (the paper's matching)", "agnostic", "bytes", None),
        ("chelsea50p25-4k", "chelsea", "ratio 0.5, protect 0.25 (kvkit, beyond the paper)", "agnostic", "bytes",
         "chelsea50-4k"),
        ("chelsea50p40cal-4k", "chelsea", "ratio 0.5, protect 0.4 (kvkit's default), calibrated protection: chunk 128, "
         "kernel 61 avg trailing", "agnostic", "bytes", "chelsea50-4k"),
        ("chelsea50rcx-4k", "chelsea", "ratio 0.5, protect 0.4 scored by context reconstruction (KVzip's score), "
         "ranked per KV head over the context (protect_score=reconstruct, protect_scope=context: kvkit)", "agnostic",
         "bytes", "chelsea50-4k"),
        ("chelsea50rc-4k", "chelsea", "ratio 0.5, protect 0.4 scored by context reconstruction, ranked per chunk "
         "(protect_score=reconstruct; stopped early)", "agnostic", "bytes", "chelsea50-4k"),
        ("snapkv2048cal-4k", "snapkv", "budget 2048, calibrated pooling (kernel 61, avg)", "agnostic", "bytes",
         "snapkv2048-4k"),
        ("snapkv2048-4k", "snapkv", "budget 2048, paper pooling", "agnostic", "bytes", None),
        ("snapkv2048tr-4k", "snapkv", "budget 2048, calibrated pooling (kernel 61, avg, trailing window: kvkit)", "agnostic",
         "bytes", "snapkv2048cal-4k"),
        ("cake2048tr-4k", "cake", "budget 2048, calibrated: kernel 61, trailing window (kvkit), taus (1, 1)", "agnostic",
         "bytes", "cake2048cal-4k"),
        ("kvzip2048-4k", "kvzip", "budget 2048, uniform per layer, no instruction", "agnostic",
         "bytes", "kvzip2048i-4k"),
        ("kvzip2048i-4k", "kvzip", "budget 2048, uniform per layer, the paper's instruction", "agnostic",
         "bytes", None),
        ("kvzip2048a-4k", "kvzip", "budget 2048 on average, layers ranked together (adaptive: the default, the paper's ranking)",
         "agnostic", "bytes", None),
        ("snapkv2048tr-4k-qaware", "snapkv", "budget 2048, calibrated pooling (kernel 61, avg, trailing window: kvkit)",
         "question in prefill", "bytes", "snapkv2048-4k-qaware"),
        ("cake2048tr-4k-qaware", "cake", "budget 2048, calibrated: kernel 61, trailing window (kvkit), taus (1, 1)",
         "question in prefill", "bytes", "cake2048-4k-qaware"),
        ("snapkv2048cal-4k-qaware", "snapkv", "budget 2048, calibrated pooling (kernel 61, avg)", "question in prefill",
         "bytes", "snapkv2048-4k-qaware"),
        ("snapkv2048-4k-qaware", "snapkv", "budget 2048, paper pooling (kernel 5, avg)", "question in prefill", "bytes",
         None),
        ("cake2048cal-4k-qaware", "cake", "budget 2048, calibrated taus (2, 2) and pool kernel 15", "question in prefill",
         "bytes", "cake2048-4k-qaware"),
        ("cake2048-4k-qaware", "cake", "budget 2048, calibrated taus (2, 2), paper kernel 5", "question in prefill",
         "bytes", None),
        ("chelsea50p40cal-4k-qaware", "chelsea", "ratio 0.5, protect 0.4 (kvkit's default), calibrated protection: chunk 128, "
         "kernel 61 avg trailing", "question in prefill", "bytes", "chelsea50p40-4k-qaware"),
        ("chelsea50p40-4k-qaware", "chelsea", "ratio 0.5, protect 0.4 (kvkit), fallback protection: chunk 64, kernel 7 "
         "max centered", "question in prefill", "bytes", "chelsea50-4k-qaware"),
        ("chelsea50-4k-qaware", "chelsea", "ratio 0.5, the paper's matching (protect 0)", "question in prefill", "bytes",
         None),
        ("../ruler/streaming2048-4k", "streaming", "budget 2048", "agnostic", "bytes", None),
        ("duo081c200-4k", "duo", "~81% of KV removed, pattern calibrated 200 steps", "agnostic", "bytes", "duo081-4k"),
        ("duo081-4k", "duo", "~81% of KV removed, 12-step pattern", "agnostic", "bytes", None),
        ("tidal550kv-4k", "tidal", "budget 550, kv_head, paper layers 2 + 12", "agnostic", "reads", None),
        ("cake1024-4k", "cake", "budget 1024, taus (1, 1)", "agnostic", "bytes", None),
        ("cake1024-4k-qaware", "cake", "budget 1024, taus (1, 1)", "question in prefill", "bytes", None),
        ("chelsea25-4k", "chelsea", "ratio 0.25, protect 0 (the paper's matching)", "agnostic", "bytes", None),
        ("chelsea20p16cal-4k", "chelsea", "ratio 0.2 (the paper's), protect 0.16 (kvkit's default), calibrated protection",
         "agnostic", "bytes", "chelsea20-4k"),
        ("chelsea20p16cal-4k-qaware", "chelsea", "ratio 0.2 (the paper's), protect 0.16 (kvkit's default), calibrated protection",
         "question in prefill", "bytes", None),
        ("chelsea25p125-4k", "chelsea", "ratio 0.25, protect 0.125 (kvkit, beyond the paper)", "agnostic", "bytes",
         "chelsea25-4k"),
        ("snapkv1024-4k", "snapkv", "budget 1024", "agnostic", "bytes", None),
        ("kvzip1024-4k", "kvzip", "budget 1024, uniform per layer, no instruction", "agnostic",
         "bytes", None),
        ("snapkv1024tr-4k-qaware", "snapkv", "budget 1024, calibrated pooling (kernel 61, avg, trailing window: kvkit)",
         "question in prefill", "bytes", "snapkv1024-4k-qaware"),
        ("snapkv1024cal-4k-qaware", "snapkv", "budget 1024, calibrated pooling (kernel 61, avg)", "question in prefill",
         "bytes", "snapkv1024-4k-qaware"),
        ("snapkv1024-4k-qaware", "snapkv", "budget 1024, paper pooling", "question in prefill", "bytes", None),
        ("../ruler/streaming1024-4k", "streaming", "budget 1024", "agnostic", "bytes", None),
        # run on a lent H100 (benchmarks/gpu/ruler_gpu.sh): the same samples give the same predictions as on the CPU
        # (results/policies/h100/parity.md), so these rows sit in the same table
        ("h100/cake2048cal-4k-qaware-s10", "cake", "budget 2048, calibrated taus (2, 2) and pool kernel 15, 10 per task (H100)",
         "question in prefill", "bytes", "cake2048-4k-qaware"),
        ("h100/snapkv1024cal-4k-qaware-s10", "snapkv", "budget 1024, calibrated pooling (kernel 61, avg), 10 per task (H100)",
         "question in prefill", "bytes", None),
        ("h100/tidalrf566kv-4k", "tidal", "budget 566, kv_head, layers [2, 6, ..., 26] (read-fraction calibration) (H100)",
         "agnostic", "reads", "tidal550kv-4k"),
        ("h100/cake1024cal-4k-qaware", "cake", "budget 1024, calibrated taus (2, 2) and pool kernel 15 (H100)",
         "question in prefill", "bytes", "cake1024-4k-qaware"),
        ("h100/kvzip1024a-4k", "kvzip", "budget 1024 on average, adaptive (the default) (H100)", "agnostic", "bytes",
         "kvzip1024-4k"),
        ("snapkv512tr-4k-qaware", "snapkv", "budget 512, calibrated pooling (kernel 61, avg, trailing window: kvkit)",
         "question in prefill", "bytes", "h100/snapkv512cal-4k-qaware"),
        ("h100/snapkv512cal-4k-qaware", "snapkv", "budget 512, calibrated pooling (kernel 61, avg) (H100)",
         "question in prefill", "bytes", None),
        ("h100/kvzip512a-4k", "kvzip", "budget 512 on average, adaptive (the default) (H100)", "agnostic", "bytes", None),
    ]
else:
    pol = root / "results" / "policies" / "qwen05"
    FULL = pol / "full"
    OUT, TITLE, README_TABLE = pol / "table", "Qwen2.5-Coder-0.5B-Instruct", False
    RUNS = [
        ("duo054", "duo", "~54% of KV removed, shipped pattern (200 steps on the disjoint text, session 28)", "agnostic",
         "bytes", "duo054-pattern004d"),
        ("duo054-pattern004d", "duo", "~54% of KV removed, the pattern shipped before (200 steps on the essays' first "
         "400K characters)", "agnostic", "bytes", None),
        ("streaming2048", "streaming", "budget 2048", "agnostic", "bytes", None),
        ("snapkv2048cal", "snapkv", "budget 2048, calibrated pooling (kernel 61, avg)", "agnostic", "bytes",
         "snapkv2048"),
        ("snapkv2048", "snapkv", "budget 2048, paper pooling", "agnostic", "bytes", None),
        ("kvzip2048", "kvzip", "budget 2048, uniform per layer, no instruction", "agnostic", "bytes",
         "kvzip2048i"),
        ("kvzip2048i", "kvzip", "budget 2048, uniform per layer, the paper's instruction", "agnostic",
         "bytes", None),
        ("kvzip2048a", "kvzip", "budget 2048 on average, layers ranked together (adaptive: the default, the paper's ranking)",
         "agnostic", "bytes", None),
        ("cake2048", "cake", "budget 2048", "agnostic", "bytes", None),
        ("chelsea50", "chelsea", "ratio 0.5, protect 0 (the paper's matching)", "agnostic", "bytes", None),
        ("chelsea50d", "chelsea", "ratio 0.5, protect 0.4 (kvkit's default), calibrated protection: chunk 256, kernel "
         "31 max trailing", "agnostic", "bytes", "chelsea50"),
        ("chelsea50rcx", "chelsea", "ratio 0.5, protect 0.4 scored by context reconstruction, ranked over the context "
         "(protect_score=reconstruct, protect_scope=context: kvkit)", "agnostic", "bytes", "chelsea50"),
        ("chelsea50p40cal-qaware", "chelsea", "ratio 0.5, protect 0.4 (kvkit's default), calibrated protection: chunk 256, "
         "kernel 31 max trailing",
         "question in prefill", "bytes", "chelsea50-qaware"),
        ("chelsea50-qaware", "chelsea", "ratio 0.5, the paper's matching (protect 0)", "question in prefill", "bytes",
         None),
        ("zipcachecal", "zipcache", "calibrated with code needles: 4-bit keys, values 4/2-bit 60/40", "agnostic",
         "bytes", "zipcache"),
        ("zipcache", "zipcache", "paper 4/2-bit 60/40 (number-needle calibration = paper)", "agnostic", "bytes", None),
        ("shadowkv1024", "shadowkv", "budget 1024, min_prompt 2048, calibrated rank 64", "agnostic", "bytes", None),
        ("tidalsh999kv", "tidal", "budget 999 on average, kv_head, calibrated layers [2, 6, 10, 14, 18, 22] and layer "
         "shares (kvkit: per-layer budgets that equalise the captured attention mass; stopped early, worse than uniform: "
         "not shipped)", "agnostic",
         "reads", "tidalrf999kv"),
        ("tidalrf999kv", "tidal", "budget 999, kv_head, calibrated layers [2, 6, 10, 14, 18, 22] (read-fraction "
         "calibration, uniform budgets: the default)", "agnostic", "reads", "tidal1732kv"),
        ("tidal1732kv", "tidal", "budget 1732, kv_head, paper layers 2 + 10", "agnostic", "reads", None),
        ("cake2048-qaware", "cake", "budget 2048", "question in prefill", "bytes", None),
        ("snapkv2048tr-qaware", "snapkv", "budget 2048, kernel 61 avg, trailing window (given as options: Qwen's calibration is centered)",
         "question in prefill", "bytes", "snapkv2048cal-qaware"),
        ("snapkv2048cal-qaware", "snapkv", "budget 2048, calibrated pooling (kernel 61, avg)", "question in prefill",
         "bytes", "snapkv2048-qaware"),
        ("snapkv2048-qaware", "snapkv", "budget 2048, paper pooling", "question in prefill", "bytes", None),
        ("duo081", "duo", "~81% of KV removed, shipped pattern (session 28)", "agnostic", "bytes", "duo081-pattern004d"),
        ("duo081-pattern004d", "duo", "~81% of KV removed, the pattern shipped before", "agnostic", "bytes", None),
        ("streaming1024", "streaming", "budget 1024", "agnostic", "bytes", None),
        ("snapkv1024", "snapkv", "budget 1024", "agnostic", "bytes", None),
        ("kvzip1024", "kvzip", "budget 1024, uniform per layer, no instruction", "agnostic", "bytes",
         None),
        ("cake1024", "cake", "budget 1024", "agnostic", "bytes", None),
        ("chelsea25", "chelsea", "ratio 0.25, protect 0 (the paper's matching)", "agnostic", "bytes", None),
        ("chelsea25d", "chelsea", "ratio 0.25, protect 0.2 (kvkit's default), calibrated protection", "agnostic",
         "bytes", "chelsea25"),
        ("shadowkv512", "shadowkv", "budget 512, min_prompt 2048, calibrated rank 64", "agnostic", "bytes", None),
        ("tidal550kv", "tidal", "budget 550, kv_head, paper layers 2 + 10", "agnostic", "reads", None),
        ("cake1024-qaware", "cake", "budget 1024", "question in prefill", "bytes", None),
        ("snapkv1024cal-qaware", "snapkv", "budget 1024, calibrated pooling (kernel 61, avg)", "question in prefill",
         "bytes", "snapkv1024-qaware"),
        ("snapkv1024-qaware", "snapkv", "budget 1024, paper pooling", "question in prefill", "bytes", None),
    ]
# tidal stores every byte and saves reads: (selection layers, model layers, budget) of each tidal run, for the
# per-step read fraction at the run's prompt length (kvkit.calibrate.tidal.tidal_read_fraction; the first decode step)
SMOL_SHARES = json.loads((root / "results" / "policies" / "tidalsh1132kv-4k" / "config.json").read_text())["options"][
    "layer_shares"] if (root / "results" / "policies" / "tidalsh1132kv-4k" / "config.json").exists() else None
QWEN_SHARES = json.loads((root / "kvkit" / "data" / "calibration" / "qwen2.5-coder-0.5b-instruct.json").read_text())[
    "policies"]["tidal"]["evidence"]["shares_not_shipped"]["layer_shares"]  # what tidalsh999kv used (then shipped)
READS = {"tidalrfsum1132kv-4k": ((2, 6, 10, 14, 18, 22, 26), 30, 1132),
         "tidalsh1132kv-4k": ((2, 6, 10, 14, 18, 22, 26), 30, 1132, SMOL_SHARES),
         "tidalrf999kv": ((2, 6, 10, 14, 18, 22), 24, 999),
         "tidalsh999kv": ((2, 6, 10, 14, 18, 22), 24, 999, QWEN_SHARES),
         "tidalcode1380kv-4k": ((2, 8, 14, 20, 26), 30, 1380), "tidalrf1132kv-4k": ((2, 6, 10, 14, 18, 22, 26), 30, 1132), "tidalcal1732kv-4k": ((2, 15, 21), 30, 1732),
         "tidal1732kv-4k": ((2, 12), 30, 1732), "tidal550kv-4k": ((2, 12), 30, 550),
         "h100/tidalrf566kv-4k": ((2, 6, 10, 14, 18, 22, 26), 30, 566),
         "tidal1732kv": ((2, 10), 24, 1732), "tidal550kv": ((2, 10), 24, 550)}
def _selected_reads(layout, n_layers: int, held: int, budget: int) -> float:
    """Reads of tidalsel1537kv-4k, run with tidal's select_attention="selected" (removed since: worse than the
    paper's exact selection layers): selection layers read every key but only ``budget + 1`` values."""
    f = min(1.0, (budget + 1) / held)
    reuse = n_layers - layout[0] - len(layout)
    return (layout[0] + len(layout) * (0.5 + 0.5 * f) + reuse * f) / n_layers


PAPER = {"tidal1732kv-4k": "paper layout (layers 2 + 12)",
         "tidalrf1132kv-4k": "uniform budgets (before the layer shares), kv_reduce max, budget 1132",
         "tidal1732kv": "paper layers 2 + 10 (budget 1732, reads 0.53)",
         "tidalrf999kv": "uniform budgets (before the layer shares)", "zipcache-4k": "paper 4/2-bit 60/40",
         "shadowkv1024-4k": "paper rank 30", "chelsea50-4k": "paper matching (protect 0)",
         "chelsea25-4k": "paper matching (protect 0)", "chelsea20-4k": "paper matching (protect 0)", "duo054-4k": "12-step pattern", "duo081-4k": "12-step pattern",
         "duo054-pattern004d": "pattern shipped before", "duo081-pattern004d": "pattern shipped before",
         "duo054c200-4k": "pattern shipped to session 32",
         "snapkv2048-4k-qaware": "paper pooling (kernel 5, avg)", "snapkv2048-4k": "paper pooling (kernel 5, avg)",
         "cake2048-4k-qaware": "paper kernel 5", "cake2048-4k": "taus (1, 1), kernel 5",
         "snapkv1024-4k-qaware": "paper pooling (kernel 5, avg)", "zipcache": "paper 4/2-bit 60/40",
         "snapkv2048": "paper pooling (kernel 5, avg)", "snapkv2048-qaware": "paper pooling (kernel 5, avg)",
         "snapkv1024-qaware": "paper pooling (kernel 5, avg)", "kvzip2048i-4k": "paper's instruction prompt",
         "kvzip2048i": "paper's instruction prompt",
         "tidal550kv-4k": "paper layout (layers 2 + 12)", "cake1024-4k-qaware": "taus (1, 1), kernel 5",
         "kvzip1024-4k": "uniform per layer", "snapkv2048cal-4k": "centered window (kernel 61)",
         "cake2048cal-4k": "taus (2, 2), centered kernel 15",
         "h100/snapkv512cal-4k-qaware": "centered window (kernel 61)",
         "snapkv2048cal-qaware": "centered window (calibrated kernel 61)",
         "chelsea50-4k-qaware": "paper matching (protect 0)", "chelsea50-qaware": "paper matching (protect 0)",
         "chelsea50": "paper matching (protect 0)", "chelsea25": "paper matching (protect 0)",
         "chelsea50p40-4k-qaware": "fallback protection (chunk 64, kernel 7 max centered)"}


def rows(folder):
    p = folder / "samples.jsonl"
    if not p.exists():
        return {}
    out = {}
    for line in p.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            out[r["id"]] = r
    return out


def score(rs, ids):
    """Mean over tasks of the per-task mean score x 100 (RULER's average), on ``ids``."""
    tasks = {}
    for i in ids:
        tasks.setdefault(rs[i]["task"], []).append(rs[i]["score"])
    return 100 * statistics.mean(statistics.mean(v) for v in tasks.values()) if tasks else float("nan")


full = rows(FULL)
out = []
for folder, policy, setting, protocol, saves, paper in RUNS:
    rs = rows(pol / folder)
    ids = sorted(i for i in rs if i in full)
    if not ids:
        out.append(dict(run=folder, policy=policy, setting=setting, protocol=protocol, samples=0))
        continue
    per_task = {}
    for i in ids:
        per_task.setdefault(rs[i]["task"], 0)
        per_task[rs[i]["task"]] += 1
    f = score(full, ids)
    a = score(rs, ids)
    kv = statistics.mean(rs[i]["kv_bytes"] for i in ids) / statistics.mean(full[i]["kv_bytes"] for i in ids)
    reads = None
    if folder in READS:
        from kvkit.calibrate.tidal import tidal_read_fraction

        layout, n_layers, budget, *rest = READS[folder]  # rest: layer_shares
        reads = statistics.mean(tidal_read_fraction(layout, n_layers, rs[i]["prompt_tokens"] + 1, budget, *rest)
                                for i in ids)
    elif folder == "tidalsel1537kv-4k":
        reads = statistics.mean(_selected_reads((2, 6, 10, 14, 18, 22, 26), 30, rs[i]["prompt_tokens"] + 1, 1537)
                                for i in ids)
    row = dict(run=folder, policy=policy, setting=setting, protocol=protocol, samples=len(ids),
               tasks=len(per_task), min_per_task=min(per_task.values()) if len(per_task) == 13 else 0,
               average=round(a, 2), full_same=round(f, 2), retention=round(a / f, 3) if f else None,
               kv_vs_full=round(kv, 3), reads_vs_full=None if reads is None else round(reads, 3), saves=saves)
    if paper:
        pr = rows(pol / paper)
        pids = [i for i in ids if i in pr]
        if pids:
            row["paper_setting"] = PAPER[paper]
            row["paper_same_samples"] = f"{len(pids)}: {score(pr, pids):.2f} (retention {score(pr, pids) / score(full, pids):.2f})"
    out.append(row)

cols = ["policy", "setting", "protocol", "samples", "tasks", "min_per_task", "average", "full_same", "retention",
        "kv_vs_full", "reads_vs_full", "paper_setting", "paper_same_samples", "run"]
lines = ["| " + " | ".join(c.replace("_", " ") for c in cols) + " |", "|" + "---|" * len(cols)]
for r in out:
    lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
md = "\n".join(lines) + "\n"
OUT.with_suffix(".md").write_text(
    f"# Issue 19: every policy on RULER-4K, {TITLE} (matched samples)\n\n"
    f"Generated by `python benchmarks/policies/issue19_table.py --model {args.model}`. retention = average / full's average on the "
    "same samples (mean over the tasks present). kv vs full = mean `KVCache.nbytes()` after generation / "
    "full's (tidal keeps every byte and saves reads: reads vs full = K/V read per decode step / full's at the "
    "samples' length). tasks = tasks with at least one sample (of 13); "
    "min per task is 0 until every task has a sample. paper same samples = the paper-setting run of the "
    "same policy scored on exactly the samples of this row.\n\n" + md, encoding="utf-8")
with open(OUT.with_suffix(".csv"), "w", newline="", encoding="utf-8") as fh:
    w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(out)
readme = pol / "README.md"
text = readme.read_text(encoding="utf-8") if README_TABLE else ""
start, end = "<!-- issue19 table -->\n", "<!-- /issue19 table -->"
if README_TABLE and start in text and end in text:
    i, j = text.index(start) + len(start), text.index(end)
    readme.write_text(text[:i] + md + text[j:], encoding="utf-8")
print(md)
