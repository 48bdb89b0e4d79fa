"""KVzip diagnosis: the fresh needles kvzip-2048 lost (full answered), re-run with option variants.
Run from the repository root after results/needles/default-4k-agnostic exists:
    python benchmarks/needles/kvzip_lost.py [number of variants, default 3] [variant options as JSON objects ...]"""
import json
import sys
import time
from pathlib import Path

import kvkit
from kvkit.evals import needles
from kvkit.evals.generation import generate
from kvkit.evals.ruler import score
from kvkit.models import load_default

root = Path("results/needles/default-4k-agnostic")
f = {r["id"]: r for r in map(json.loads, (root / "full" / "samples.jsonl").read_text().splitlines())}
k = {r["id"]: r for r in map(json.loads, (root / "kvzip-2048" / "samples.jsonl").read_text().splitlines())}
lost = [i for i in k if f[i]["score"] == 1 and k[i]["score"] < 1]
model, tok = load_default()
samples = {s["id"]: s for s in needles.generate_samples(tok, [4096], 33, seed=needles.DEFAULT_SEED)}
variants = [json.loads(a) for a in sys.argv[2:]] or [dict(budget=2048, adaptive=False), dict(budget=2048, instruct=True), dict(budget=2048, chunk=2048)]
for opts in variants[: int(sys.argv[1]) if len(sys.argv) > 1 else 3]:
    kvkit.patch(model, "kvzip", **opts)
    t = time.time()
    got = 0
    for i in lost:
        s = samples[i]
        g = generate(model, tok, s["prompt"], s["tokens_to_generate"], s["context_end"])
        sc = score(s["metric"], g.text, s["outputs"])
        got += sc
        print(opts, i, s["task"], repr(g.text[:40]), sc, flush=True)
    kvkit.unpatch(model)
    print("==", opts, f"{got}/{len(lost)} of the lost needles back", round(time.time() - t), "s", flush=True)
