"""Timing of batched decode: interleaved rounds of timed decode steps over several :class:`DecodeRun` s, the
``torch.profiler`` top ops of a few steps, and the rows that turn the step times into medians, tokens/s and
speed-ups over the full cache.

Interleaving (round ``k``: every run decodes ``steps`` timed steps, the order rotated by ``k``) makes a shared,
noisy CPU slow every policy alike; each speed-up is a ratio of medians taken under the same load. Row fields:
``step_ms`` (median wall time of a step), ``tok_s`` (``batch / step``), ``cpu_ms`` (median process CPU time, all
threads), ``kv_held`` / ``kv_read_step`` (bytes), and against a full run of the same batch ``speedup``, ``bound``
(:func:`kvkit.evals.bench.fit.byte_bound`) and ``fraction`` of the way to it.
"""

from __future__ import annotations

import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import kvkit
from kvkit.evals.bench.configs import config_label
from kvkit.evals.bench.fit import byte_bound, fraction_of_bound
from kvkit.evals.bench.runs import DecodeRun, decode_step


def decode_rounds(model, runs: list[DecodeRun], threads: list[int], rounds: int, steps: int, warmup: int = 1,
                  bar=None) -> None:
    """Interleaved decode rounds: for each thread count, ``warmup`` untimed steps per policy, then ``rounds``
    rounds in which every policy decodes ``steps`` timed steps (order rotated by one each round)."""
    with torch.no_grad():
        for t in threads:
            torch.set_num_threads(t)
            for r in runs:
                kvkit.patch(model, r.name, **r.options)
                try:
                    for _ in range(warmup):
                        decode_step(model, r)
                finally:
                    kvkit.unpatch(model)
                r.times[t], r.cpu[t] = [], []
            for k in range(rounds):
                order = runs[k % len(runs):] + runs[:k % len(runs)]
                for r in order:
                    kvkit.patch(model, r.name, **r.options)
                    try:
                        for _ in range(steps):
                            r.times[t].append(decode_step(model, r))
                            r.cpu[t].append(r.last_cpu)
                    finally:
                        kvkit.unpatch(model)
                    if bar is not None:
                        bar.update(1)


def profile_runs(model, runs: list[DecodeRun], steps: int = 3, top: int = 12) -> dict:
    """``torch.profiler`` over ``steps`` decode steps of each policy (after one untimed step): the ops with the
    most self CPU time, per step. Returns ``{label: {"step_ms": ..., "ops": [{name, self_ms, pct, calls}]}}``."""
    res = {}
    with torch.no_grad():
        for r in runs:
            kvkit.patch(model, r.name, **r.options)
            try:
                decode_step(model, r)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t = sum(decode_step(model, r) for _ in range(steps))
            finally:
                kvkit.unpatch(model)
            ev = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
            total = sum(e.self_cpu_time_total for e in ev) or 1.0
            ev.sort(key=lambda e: -e.self_cpu_time_total)
            res[config_label(r.name, r.options)] = dict(
                step_ms=round(t / steps * 1e3, 2), profiled_self_ms=round(total / 1e3 / steps, 2),
                ops=[dict(name=e.key, self_ms=round(e.self_cpu_time_total / 1e3 / steps, 3),
                          pct=round(100 * e.self_cpu_time_total / total, 1), calls=round(e.count / steps, 1))
                     for e in ev[:top]])
    return res


def _median(xs):
    return statistics.median(xs) if xs else None


def step_rows(runs: list[DecodeRun], threads: list[int], weights: int, length: int) -> list[dict]:
    """One row per (policy, threads): median step, tok/s, KV held / read, speed-up over full (ratio of median
    steps), byte bound and the fraction of the way to it."""
    rows = []
    full = next((r for r in runs if r.name == "full" and not r.options), None)
    for t in threads:
        f_step = _median(full.times[t]) if full is not None else None
        f_cpu = _median(full.cpu[t]) if full is not None else None
        f_read = int(full.cache.read_nbytes()) if full is not None else None
        for r in runs:
            step = _median(r.times[t])
            cpu = _median(r.cpu[t])
            read = int(r.cache.read_nbytes())
            held_seq = r.kv_held / r.batch
            tok_s = r.batch / step
            row = dict(policy=r.name, options=r.options, label=config_label(r.name, r.options), batch=r.batch,
                       length=length, threads=t, steps=len(r.times[t]), step_ms=round(step * 1e3, 2),
                       step_ms_mean=round(sum(r.times[t]) / len(r.times[t]) * 1e3, 2),
                       step_ms_min=round(min(r.times[t]) * 1e3, 2), step_ms_max=round(max(r.times[t]) * 1e3, 2),
                       tok_s=round(tok_s, 2), kv_held=r.kv_held, kv_held_per_seq=int(held_seq),
                       kv_offloaded=r.kv_offloaded, kv_read_step=read, weights=weights,
                       prefill_s=round(r.prefill_s, 2), replayed_prefill=r.replayed,
                       cpu_ms=round(cpu * 1e3, 2), cpu_ms_mean=round(sum(r.cpu[t]) / len(r.cpu[t]) * 1e3, 2))
            if f_step and full.batch == r.batch:
                speed = f_step / step
                bound = byte_bound(weights, f_read, read)
                row.update(speedup=round(speed, 3), bound=round(bound, 3),
                           fraction=None if fraction_of_bound(speed, bound) is None
                           else round(fraction_of_bound(speed, bound), 3),
                           kv_held_vs_full=round(r.kv_held / max(1, full.kv_held), 4),
                           kv_read_vs_full=round(read / max(1, f_read), 4))
                cspeed = f_cpu / max(cpu, 1e-9)
                cfrac = fraction_of_bound(cspeed, bound)
                row.update(cpu_speedup=round(cspeed, 3), cpu_fraction=None if cfrac is None else round(cfrac, 3))
            rows.append(row)
    return rows


def pair_rows(full: DecodeRun, r: DecodeRun, threads, weights, length) -> list[dict]:
    """Rows of one policy and the full cache it was interleaved with (same batch or not)."""
    pair = step_rows([full, r] if r is not full else [full], threads, weights, length)
    base = {x["threads"]: x for x in pair if x["label"] == "full"}
    for x in pair:
        b = base[x["threads"]]
        x.update(full_step_ms=b["step_ms"], full_tok_s=b["tok_s"], full_batch=b["batch"],
                 throughput_vs_full=round(x["tok_s"] / b["tok_s"], 3), batch_vs_full=round(x["batch"] / b["batch"], 3))
    return pair
