"""Prefill time of one ~3.9K-token RULER context on the default model: full vs kvzip (prefill + reconstruction).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/policies/profile_kvzip.py [--profile]

``--profile`` prints torch.profiler's top operators of the kvzip prefill (where the reconstruction spends its time).
"""

import argparse
import json
import pathlib
import time

import torch

import kvkit
from kvkit.models import load

ap = argparse.ArgumentParser()
ap.add_argument("--profile", action="store_true")
args = ap.parse_args()
torch.set_num_threads(1)
root = pathlib.Path(__file__).resolve().parents[2]
s = json.loads((root / "results/ruler/prompts/ruler-4096-s5.jsonl").open().readline())
model, tok = load("default")
ctx = tok(s["prompt"][: s["context_end"]], return_tensors="pt").input_ids
for pol, opts in [("full", {}), ("kvzip", dict(budget=2048))]:
    kvkit.patch(model, pol, **opts)
    t = time.perf_counter()
    with torch.no_grad():
        if args.profile and pol == "kvzip":
            from torch.profiler import profile

            with profile() as prof:
                kvkit.prefill(model, ctx, chunk_size=ctx.shape[1])
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        else:
            kvkit.prefill(model, ctx, chunk_size=ctx.shape[1])
    print(f"{pol}: {ctx.shape[1]} tokens, {time.perf_counter() - t:.1f} s")
    kvkit.unpatch(model)
