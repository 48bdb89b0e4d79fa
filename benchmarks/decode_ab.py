"""Decode-step timing of several caches in one process: each policy vs `full`, and a policy against its own
file at another git revision (``--rev``).

Every cache holds the same prompt (random tokens or essays, batch x length): ``--fill replay`` records one
exact prefill and replays it into each cache (``kvkit.evals.shared_prefill``); ``--fill copy`` runs one
chunked prefill of a full cache and appends its K/V to each other cache's stores (every policy's prefill
is exact attention over the same K/V; less memory, no attention re-run). Then ``--rounds`` rounds of
``--steps`` greedy decode steps per cache, interleaved; the table gives the median step, the speed-up
over the first spec (``full``), the KV bytes read per step (``KVCache.read_nbytes``), the byte bound
``(weights + full's read) / (weights + read)`` and the fraction of the way to it. ``--profile`` prints a
``torch.profiler`` table of one decode step per listed cache.

    --spec LABEL=POLICY:k=v,k=v      POLICY_before = that policy's file at --rev (registered as POLICY_before)
    --variant LABEL=BASE:attr=v      the cache of spec BASE with a store attribute set during its steps
                                     (e.g. tidal's per_kv_head=true: kv_head selection on the same cache)

Run from the repository root: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_ab.py ...``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

import torch

import kvkit
import kvkit.models
from kvkit.compat import cache_kw
from kvkit.evals.shared_prefill import record_prefill, replay_prefill


def load_before(name, rev):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.check_output(["git", "show", f"{rev}:kvkit/policies/{name}.py"], cwd=root).decode()
    src = src.replace(f'@register("{name}")', f'@register("{name}_before")')
    mod = types.ModuleType(f"kvkit.policies.{name}_before")
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"<{name}@{rev}>", "exec"), mod.__dict__)


def parse(s):
    label, _, rest = s.partition("=")
    name, _, opts = rest.partition(":")
    d = {}
    for kv in filter(None, opts.split(",")):
        k, v = kv.split("=", 1)
        try:
            v = json.loads(v)
        except Exception:
            pass
        d[k] = v
    return label, name, d


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--spec", action="append", default=[])
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rev", default=None)
    p.add_argument("--profile", default="", help="';'-separated labels to profile (one step each)")
    p.add_argument("--prompt", default="random", choices=["random", "essay"])
    p.add_argument("--fill", default="replay", choices=["replay", "copy"],
                   help="replay: record one prefill and replay it into each cache; copy: one chunked full prefill, "
                        "its K/V appended into each cache's stores (no attention re-run; less memory)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    specs = [parse(s) for s in a.spec]
    for _, name, _ in specs:
        if name.endswith("_before"):
            load_before(name[: -len("_before")], a.rev)
    model, tok = kvkit.models.load("default")
    kvkit.patch(model, "full")
    if a.prompt == "random":
        ids = torch.randint(100, 40000, (a.batch, a.length), generator=torch.Generator().manual_seed(0))
    else:
        from kvkit.evals.bench import bench_prompt
        one = bench_prompt(tok, a.length * a.batch)[0]
        ids = one[: a.batch * a.length].view(a.batch, a.length)
    t0 = time.perf_counter()
    runs = {}
    if a.fill == "replay":
        rec = record_prefill(model, ids)
        print(f"recorded prefill {a.batch}x{a.length} in {time.perf_counter() - t0:.0f}s", flush=True)
        nxt0 = rec.logits.argmax(-1, keepdim=True)
        for label, name, opts in specs:
            t0 = time.perf_counter()
            kvkit.patch(model, name, **opts)
            cache = replay_prefill(model, rec)
            runs[label] = dict(cache=cache, nxt=nxt0, attrs={}, t=[])
            print(f"replayed {label} ({name} {opts}) in {time.perf_counter() - t0:.0f}s", flush=True)
        del rec
    else:
        full_cache = kvkit.KVCache(model, "full")
        with torch.no_grad():
            for i in range(0, a.length, 512):
                out = model(ids[:, i:i + 512], **cache_kw(full_cache), use_cache=True, logits_to_keep=1)
        nxt0 = out.logits[:, -1].argmax(-1, keepdim=True)
        print(f"chunked full prefill {a.batch}x{a.length} in {time.perf_counter() - t0:.0f}s", flush=True)
        for label, name, opts in specs:
            if name == "full":
                cache = full_cache
            else:
                cache = kvkit.KVCache(model, name, **opts)
                T = a.length
                for src, st in zip(full_cache.layers, cache.layers):
                    st.update(src.keys.clone(), src.values.clone())
                    st.mark_padding(None, T)
                    if hasattr(st, "_record_positions"):
                        st._record_positions(None, T)
                    st.committed = st.seen
            runs[label] = dict(cache=cache, nxt=nxt0, attrs={}, t=[])
            with torch.no_grad():  # first decode step now: shadowkv compresses here, its exact copy goes
                o = model(nxt0, **cache_kw(cache), use_cache=True)
            runs[label]["nxt"] = o.logits[:, -1].argmax(-1, keepdim=True)
            print(f"filled {label} ({name} {opts})", flush=True)
    kvkit.patch(model, "full")
    for v in a.variant:
        label, base, attrs = parse(v)
        runs[label] = dict(cache=runs[base]["cache"], nxt=nxt0, attrs=attrs, t=[], base=base)

    def step(label):
        r = runs[label]
        saved = {}
        for layer in r["cache"].layers:
            for k, v in r["attrs"].items():
                saved[k] = getattr(layer, k)
                setattr(layer, k, v)
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                out = model(r["nxt"], **cache_kw(r["cache"]), use_cache=True)
                dt = time.perf_counter() - t0
        finally:
            for layer in r["cache"].layers:
                for k, v in saved.items():
                    setattr(layer, k, v)
        r["nxt"] = out.logits[:, -1].argmax(-1, keepdim=True)
        r["read"] = r["cache"].read_nbytes()
        return dt

    labels = list(runs)
    for lb in labels:
        step(lb)  # warm-up (shadowkv compresses at its first decode step when not yet compressed)
    for _ in range(a.rounds):
        for lb in labels:
            for _ in range(a.steps):
                runs[lb]["t"].append(step(lb))
    ref = statistics.median(runs[labels[0]]["t"])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    full_read = runs[labels[0]]["read"]
    print(f"\nbatch {a.batch} x {a.length} ({a.prompt} tokens), {a.threads} thread(s), {a.rounds} rounds x {a.steps} "
          f"steps per cache, interleaved; median step; weights {weights / 2**20:.0f} MiB")
    print("| cache | median step (ms) | speed-up vs full | KV read/step (MiB) | byte bound | fraction of the way |")
    print("|---|---:|---:|---:|---:|---:|")
    for lb in labels:
        r = runs[lb]
        m = statistics.median(r["t"])
        bound = (weights + full_read) / (weights + r["read"])
        sp = ref / m
        frac = (sp - 1) / (bound - 1) if bound > 1.0001 else float("nan")
        print(f"| {lb} | {m * 1e3:.1f} | {sp:.2f} | {r['read'] / 2**20:.1f} | {bound:.2f} | {frac:.2f} |", flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        for lb in a.profile.split(";"):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(lb)
            print(f"\n=== profile: one decode step of {lb}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(__import__("os").environ.get("ROWS", "16"))))


if __name__ == "__main__":
    main()
