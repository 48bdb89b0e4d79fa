"""RULER-4K retention of every policy setting, one table per model: each run scored on the samples it shares with
the full cache, next to the paper setting of the same policy on exactly those samples.

Reads the run folders' samples.jsonl (partial runs welcome; the commands that fill them:
benchmarks/policies/run_policy_table.sh). Run from anywhere:
    python benchmarks/policies/policy_table.py                 # SmolLM2-135M -> results/ruler/policies-smollm2-4k.md (+ .csv)
    python benchmarks/policies/policy_table.py --model qwen05  # Qwen2.5-Coder-0.5B -> results/ruler/policies-qwen05-4k.md

Each row: (run folder, policy, setting, short label for the figure, protocol, run of the paper setting to compare
on the same samples or None, drawn in results/ruler/retention.png). "agnostic": the context is prefilled and
compressed before the question is fed; "question in prefill": context and question in one prefill.
"""

import argparse
import csv
import json
import pathlib
import statistics
import sys

root = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))
RULER = root / "results" / "ruler"
AG, QA = "agnostic", "question in prefill"

SMOLLM2 = [
    # ~50% of the KV removed (or of the reads, tidal)
    ("duo054-4k120", "duo", "sparsity 0.54, shipped pattern", "duo, shipped pattern", AG, None, True),
    ("duo054-4k", "duo", "sparsity 0.54, 12-step CPU pattern (benchmarks/replay/duo_smollm2_2fa10fc.json)",
     "duo, 12-step pattern", AG, None, False),
    ("tidalshared1132-4k", "tidal", "budget 1132, shared selection, calibrated layers and layer shares (default)",
     "tidal 1132, shared", AG, "tidal1732kv-4k", True),
    ("tidalsh1132kv-4k", "tidal", "budget 1132, selection=kv_head, calibrated layers and layer shares",
     "tidal 1132, kv_head", AG, "tidal1732kv-4k", True),
    ("tidal1732kv-4k", "tidal", "budget 1732, selection=kv_head, the paper's layers 2 + 12 (calibrated=False)",
     "tidal 1732, paper layers", AG, None, True),
    ("zipcachecal-4k", "zipcache", "calibrated: every K and V at 4 bits; per-channel statistics (key_group=None, "
     "stats=auto)", "zipcache, 4-bit", AG, "zipcache-4k", True),
    ("zipcache-4k", "zipcache", "the paper's 4/2-bit split (calibrated=False, key_group=None, stats=auto)",
     "zipcache, paper 4/2-bit", AG, None, True),
    ("zipcache84-4k", "zipcache", "8-bit / 4-bit split (high_bits=8, low_bits=4, calibrated=False, key_group=None, "
     "stats=auto)", "zipcache, 8/4-bit", AG, None, True),
    ("shadowkvcal2048-4k", "shadowkv", "budget 2048 (the paper's), min_prompt 2048, calibrated rank 120",
     "shadowkv 2048", AG, None, True),
    ("shadowkvcal1024-4k", "shadowkv", "budget 1024, min_prompt 2048, calibrated rank 120", "shadowkv 1024", AG,
     "shadowkv1024-4k", True),
    ("shadowkv1024-4k", "shadowkv", "budget 1024, min_prompt 2048, the paper's rank 30 (calibrated=False)",
     "shadowkv 1024, paper rank", AG, None, True),
    ("cake2048tr-4k", "cake", "budget 2048, calibrated: pool kernel 61, trailing window, taus (1, 1)",
     "cake 2048", AG, "cake2048-4k", True),
    ("cake2048-4k", "cake", "budget 2048, the paper's kernel 5, taus (1, 1) (calibrated=False)",
     "cake 2048, paper", AG, None, True),
    ("chelsea50p40cal-4k", "chelsea", "ratio 0.5, protect 0.4 (default), calibrated protection: chunk 128, kernel "
     "61 avg trailing", "chelsea 0.5, protect 0.4", AG, "chelsea50-4k", True),
    ("chelsea50-4k", "chelsea", "ratio 0.5, the paper's matching (protect=0)", "chelsea 0.5, paper", AG, None, True),
    ("chelsea50rcx-4k", "chelsea", "ratio 0.5, protect 0.4 scored by context reconstruction, ranked over the "
     "context (protect_score=reconstruct, protect_scope=context)", "chelsea 0.5, reconstruct", AG, "chelsea50-4k",
     True),
    ("snapkv2048tr-4k", "snapkv", "budget 2048, calibrated: kernel 61 avg, trailing window", "snapkv 2048", AG,
     "snapkv2048-4k", True),
    ("snapkv2048-4k", "snapkv", "budget 2048, the paper's kernel 5 avg (calibrated=False)", "snapkv 2048, paper",
     AG, None, False),
    ("kvzip2048a-4k", "kvzip", "budget 2048 on average, layers ranked together (default, the paper's ranking)",
     "kvzip 2048", AG, None, True),
    ("kvzip2048-4k", "kvzip", "budget 2048, uniform per layer (adaptive=false)", "kvzip 2048, uniform", AG, None,
     True),
    ("streaming2048-4k", "streaming", "budget 2048", "streaming 2048", AG, None, True),
    # ~75% removed and below
    ("tidal550kv-4k", "tidal", "budget 550, selection=kv_head, the paper's layers 2 + 12 (calibrated=False)",
     "tidal 550, paper layers", AG, None, True),
    ("cake1024-4k", "cake", "budget 1024, the paper's kernel 5, taus (1, 1) (calibrated=False)",
     "cake 1024, paper", AG, None, True),
    ("chelsea20p16cal-4k", "chelsea", "ratio 0.2 (the paper's), protect 0.16 (default), calibrated protection",
     "chelsea 0.2, protect 0.16", AG, "chelsea20-4k", True),
    ("chelsea20-4k", "chelsea", "ratio 0.2, the paper's matching (protect=0)", "chelsea 0.2, paper", AG, None,
     False),
    ("kvzip1024a-4k-h100", "kvzip", "budget 1024 on average, layers ranked together (default; H100)",
     "kvzip 1024", AG, "kvzip1024-4k", True),
    ("kvzip1024-4k", "kvzip", "budget 1024, uniform per layer (adaptive=false)", "kvzip 1024, uniform", AG, None,
     False),
    ("kvzip512a-4k-h100", "kvzip", "budget 512 on average, layers ranked together (default; H100)", "kvzip 512", AG,
     None, True),
    ("streaming1024-4k", "streaming", "budget 1024", "streaming 1024", AG, None, True),
    ("streaming512-4k", "streaming", "budget 512", "streaming 512", AG, None, True),
    # question in the prefill (the eviction papers' protocol)
    ("snapkv2048tr-4k-qaware", "snapkv", "budget 2048, calibrated: kernel 61 avg, trailing window", "snapkv 2048",
     QA, "snapkv2048-4k-qaware", True),
    ("snapkv2048-4k-qaware", "snapkv", "budget 2048, the paper's kernel 5 avg (calibrated=False)",
     "snapkv 2048, paper", QA, None, True),
    ("snapkv1024tr-4k-qaware", "snapkv", "budget 1024, calibrated: kernel 61 avg, trailing window", "snapkv 1024",
     QA, "snapkv1024-4k-qaware", True),
    ("snapkv1024-4k-qaware", "snapkv", "budget 1024, the paper's kernel 5 avg (calibrated=False)",
     "snapkv 1024, paper", QA, None, False),
    ("snapkv512tr-4k-qaware", "snapkv", "budget 512, calibrated: kernel 61 avg, trailing window", "snapkv 512", QA,
     None, True),
    ("cake2048tr-4k-qaware", "cake", "budget 2048, calibrated: pool kernel 61, trailing window, taus (1, 1)",
     "cake 2048", QA, None, True),
    ("cake1024-4k-qaware", "cake", "budget 1024, the paper's kernel 5, taus (1, 1) (calibrated=False)",
     "cake 1024, paper", QA, None, True),
    ("chelsea50p40cal-4k-qaware", "chelsea", "ratio 0.5, protect 0.4 (default), calibrated protection",
     "chelsea 0.5, protect 0.4", QA, "chelsea50-4k-qaware", True),
    ("chelsea50-4k-qaware", "chelsea", "ratio 0.5, the paper's matching (protect=0)", "chelsea 0.5, paper", QA,
     None, True),
    ("chelsea20p16cal-4k-qaware", "chelsea", "ratio 0.2, protect 0.16 (default), calibrated protection",
     "chelsea 0.2, protect 0.16", QA, None, True),
]
QWEN05 = [
    ("duo054", "duo", "sparsity 0.54, shipped pattern", "duo 0.54", AG, None, True),
    ("tidalrf999kv", "tidal", "budget 999, selection=kv_head, calibrated layers [2, 6, ..., 22]",
     "tidal 999, kv_head", AG, "tidal1732kv", True),
    ("tidal1732kv", "tidal", "budget 1732, selection=kv_head, the paper's layers 2 + 10 (calibrated=False)",
     "tidal 1732, paper layers", AG, None, True),
    ("zipcachecal", "zipcache", "calibrated: 4-bit keys, values 60% 4-bit / 40% 2-bit; per-channel statistics "
     "(key_group=None, stats=auto)", "zipcache, 4-bit keys", AG, "zipcache", True),
    ("zipcache", "zipcache", "the paper's 4/2-bit split (calibrated=False, key_group=None, stats=auto)",
     "zipcache, paper 4/2-bit", AG, None, True),
    ("shadowkv1024", "shadowkv", "budget 1024, min_prompt 2048, calibrated rank 64", "shadowkv 1024", AG, None,
     True),
    ("cake2048", "cake", "budget 2048 (no calibration for this model: the paper's setting)", "cake 2048", AG, None,
     True),
    ("chelsea50d", "chelsea", "ratio 0.5, protect 0.4 (default), calibrated protection: chunk 256, kernel 31 max "
     "trailing", "chelsea 0.5, protect 0.4", AG, "chelsea50", True),
    ("chelsea50", "chelsea", "ratio 0.5, the paper's matching (protect=0)", "chelsea 0.5, paper", AG, None, True),
    ("chelsea50rcx", "chelsea", "ratio 0.5, protect 0.4 scored by context reconstruction, ranked over the context "
     "(protect_score=reconstruct, protect_scope=context)", "chelsea 0.5, reconstruct", AG, "chelsea50", False),
    ("snapkv2048cal", "snapkv", "budget 2048, calibrated: kernel 61 avg, centered window", "snapkv 2048", AG,
     "snapkv2048", True),
    ("snapkv2048", "snapkv", "budget 2048, the paper's kernel 5 avg (calibrated=False)", "snapkv 2048, paper", AG,
     None, False),
    ("kvzip2048a", "kvzip", "budget 2048 on average, layers ranked together (default)", "kvzip 2048", AG, None, True),
    ("kvzip2048", "kvzip", "budget 2048, uniform per layer (adaptive=false)", "kvzip 2048, uniform", AG, None, True),
    ("streaming2048", "streaming", "budget 2048", "streaming 2048", AG, None, True),
    ("duo081", "duo", "sparsity 0.81, shipped pattern", "duo 0.81", AG, None, True),
    ("tidal550kv", "tidal", "budget 550, selection=kv_head, the paper's layers 2 + 10 (calibrated=False)",
     "tidal 550, paper layers", AG, None, True),
    ("shadowkv512", "shadowkv", "budget 512, min_prompt 2048, calibrated rank 64", "shadowkv 512", AG, None, True),
    ("cake1024", "cake", "budget 1024 (the paper's setting)", "cake 1024", AG, None, True),
    ("chelsea25d", "chelsea", "ratio 0.25, protect 0.2 (default), calibrated protection", "chelsea 0.25, protect 0.2",
     AG, "chelsea25", True),
    ("chelsea25", "chelsea", "ratio 0.25, the paper's matching (protect=0)", "chelsea 0.25, paper", AG, None, False),
    ("snapkv1024", "snapkv", "budget 1024, the paper's kernel 5 avg (calibrated=False)", "snapkv 1024, paper", AG,
     None, True),
    ("streaming1024", "streaming", "budget 1024", "streaming 1024", AG, None, True),
    ("cake2048-qaware", "cake", "budget 2048 (the paper's setting)", "cake 2048", QA, None, True),
    ("cake1024-qaware", "cake", "budget 1024 (the paper's setting)", "cake 1024", QA, None, True),
    ("snapkv2048cal-qaware", "snapkv", "budget 2048, calibrated: kernel 61 avg, centered window", "snapkv 2048", QA,
     "snapkv2048-qaware", True),
    ("snapkv2048tr-qaware", "snapkv", "budget 2048, kernel 61 avg, trailing window (options)",
     "snapkv 2048, trailing", QA, "snapkv2048cal-qaware", False),
    ("snapkv2048-qaware", "snapkv", "budget 2048, the paper's kernel 5 avg (calibrated=False)", "snapkv 2048, paper",
     QA, None, True),
    ("snapkv1024cal-qaware", "snapkv", "budget 1024, calibrated: kernel 61 avg, centered window", "snapkv 1024", QA,
     "snapkv1024-qaware", True),
    ("snapkv1024-qaware", "snapkv", "budget 1024, the paper's kernel 5 avg (calibrated=False)", "snapkv 1024, paper",
     QA, None, True),
    ("chelsea50p40cal-qaware", "chelsea", "ratio 0.5, protect 0.4 (default), calibrated protection",
     "chelsea 0.5, protect 0.4", QA, "chelsea50-qaware", True),
    ("chelsea50-qaware", "chelsea", "ratio 0.5, the paper's matching (protect=0)", "chelsea 0.5, paper", QA, None,
     True),
]
MODELS = {"default": ("smollm2-4k", "SmolLM2-135M-Instruct (the default model)", SMOLLM2, "full-4k"),
          "qwen05": ("qwen05-4k", "Qwen2.5-Coder-0.5B-Instruct", QWEN05, "full")}
# tidal holds every byte and saves reads: (selection layers, model layers, budget, layer shares) of each tidal run,
# for the per-step read fraction at the run's prompt length (kvkit.calibrate.tidal.tidal_read_fraction)
SHARES = [1, 1, 1, 1.695, 1.148, 1.258, 1, 1.367, 0.82, 0.602, 1, 0.93, 1.148, 0.93, 1, 1.094, 0.109, 1.148, 1, 1.422,
          0.875, 1.531, 1, 0.547, 0.984, 0.055, 1, 0.273, 1.312, 1.75]
READS = {"tidalshared1132-4k": ((2, 6, 10, 14, 18, 22, 26), 30, 1132, SHARES),
         "tidalsh1132kv-4k": ((2, 6, 10, 14, 18, 22, 26), 30, 1132, SHARES),
         "tidal1732kv-4k": ((2, 12), 30, 1732), "tidal550kv-4k": ((2, 12), 30, 550),
         "tidalrf999kv": ((2, 6, 10, 14, 18, 22), 24, 999),
         "tidal1732kv": ((2, 10), 24, 1732), "tidal550kv": ((2, 10), 24, 550)}
COLS = ["policy", "setting", "protocol", "samples", "average", "full_same", "retention", "kv_vs_full",
        "reads_vs_full", "paper_same_samples", "run"]


def rows(folder: pathlib.Path) -> dict:
    p = folder / "samples.jsonl"
    out = {}
    if p.exists():
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                out[r["id"]] = r
    return out


def score(rs: dict, ids) -> float:
    """Mean over tasks of the per-task mean score x 100 (RULER's average), on ``ids``."""
    tasks: dict = {}
    for i in ids:
        tasks.setdefault(rs[i]["task"], []).append(rs[i]["score"])
    return 100 * statistics.mean(statistics.mean(v) for v in tasks.values()) if tasks else float("nan")


def build(model: str) -> list[dict]:
    sub, _, runs, full_run = MODELS[model]
    here = RULER / sub
    full = rows(here / full_run)
    out = []
    for folder, policy, setting, label, protocol, paper, drawn in runs:
        rs = rows(here / folder)
        ids = sorted(i for i in rs if i in full)
        if not ids:
            raise SystemExit(f"{here / folder}: no samples shared with {here / full_run}")
        f, a = score(full, ids), score(rs, ids)
        kv = statistics.mean(rs[i]["kv_bytes"] for i in ids) / statistics.mean(full[i]["kv_bytes"] for i in ids)
        reads = None
        if folder in READS:
            from kvkit.calibrate.tidal import tidal_read_fraction

            layout, n_layers, budget, *shares = READS[folder]
            reads = statistics.mean(tidal_read_fraction(layout, n_layers, rs[i]["prompt_tokens"] + 1, budget, *shares)
                                    for i in ids)
        row = dict(run=f"{sub}/{folder}", policy=policy, setting=setting, label=label, protocol=protocol,
                   samples=len(ids), average=round(a, 2), full_same=round(f, 2), retention=round(a / f, 3),
                   kv_vs_full=round(kv, 3), reads_vs_full="" if reads is None else round(reads, 3), drawn=drawn)
        if paper:
            pr = rows(here / paper)
            pids = [i for i in ids if i in pr]
            if pids:
                row["paper_same_samples"] = (f"{score(pr, pids) / score(full, pids):.2f} on {len(pids)} "
                                             f"({paper})")
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="default")
    args = ap.parse_args()
    sub, title, _, _ = MODELS[args.model]
    out = build(args.model)
    head = ["policy", "setting", "protocol", "samples", "average", "full, same samples", "retention", "KV x full",
            "reads x full", "paper setting, same samples", "run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in out:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in COLS) + " |")
    stem = RULER / f"policies-{sub}"
    stem.with_suffix(".md").write_text(
        f"# RULER-4K retention, {title}\n\n"
        f"Made by `python benchmarks/policies/policy_table.py --model {args.model}` from the run folders under "
        f"`results/ruler/{sub}/`. retention = average / the full cache's average on the same samples (RULER's "
        "average: mean over tasks of the per-task mean score). KV x full = mean `KVCache.nbytes()` after generation "
        "/ full's; reads x full (tidal, which holds every byte) = K/V read per decode step / full's. paper setting = "
        "the same policy with the paper's setting, retention on this row's samples.\n\n" + "\n".join(lines) + "\n",
        encoding="utf-8")
    with open(stem.with_suffix(".csv"), "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=COLS + ["label", "drawn"], extrasaction="ignore")
        w.writeheader()
        w.writerows(out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
