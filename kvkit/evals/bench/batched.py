"""``kvkit bench --batch B``: batched decode of the full cache and every policy on the same left-padded batch of
essay passages, each policy paired with a fresh full cache, at each thread count; optionally the largest batch
each policy's KV fits in a memory budget and the throughput there (``--memory``), and profiles (``--profile``).

Every policy is prefilled on the batch ``[B, length]`` (replayed from one recorded exact prefill when the policy's
prefill is exact, :mod:`kvkit.evals.bench.replay`), then it and a fresh full cache decode in interleaved rounds
(:func:`kvkit.evals.bench.timing.decode_rounds`), so only two caches are alive at a time. The result is a dict:
``rows`` (one per policy and thread count, :func:`kvkit.evals.bench.timing.step_rows`), with ``--memory`` also
``fits`` (one per policy) and ``memory`` (the pairs at the fit batches), with ``--profile`` ``profile``
(``{label: {"step_ms", "ops"}}``), plus the run's settings.
"""

from __future__ import annotations

import dataclasses
import gc
import types
from dataclasses import dataclass

import torch

import kvkit
from kvkit.evals.bench.configs import check_configs, config_label, positive_int
from kvkit.evals.bench.fit import HEADROOM_TOKENS, full_token_bytes, memory_fit, weight_bytes
from kvkit.evals.bench.prompts import batch_prompts
from kvkit.evals.bench.replay import record_prefill_spilled
from kvkit.evals.bench.runs import DecodeRun, prefill_run
from kvkit.evals.bench.timing import decode_rounds, pair_rows, profile_runs, step_rows
from kvkit.evals.runner import progress
from kvkit.workloads.prompts import check_length
from kvkit.workloads.shared_prefill import replayable


@dataclass
class _Setup:
    """What every pair of one decode bench shares: the model, the prompt batch ``ids`` / ``mask`` ``[B, length]``
    and its recorded prefill (None when no policy replays it), the thread counts and rounds, the prefill's thread
    count, the weights' bytes and the log."""

    model: object
    ids: object
    mask: object
    rec: object
    threads: list[int]
    rounds: int
    steps: int
    pthreads: int
    weights: int
    length: int
    log: object


def decoded_tokens(n_threads: int, rounds: int, steps: int, profile: bool = False, profile_steps: int = 3) -> int:
    """Tokens :func:`decode_bench` decodes after a prompt (its warm-up and timed steps per thread count, and the
    profiled ones): the room the prompt must leave in the model's context."""
    return n_threads * (1 + rounds * steps) + (1 + profile_steps if profile else 0)


def decode_bench(model, tokenizer, configs, batch: int = 8, length: int = 4096, threads=(1,), rounds: int = 3,
                 steps: int = 4, memory_gib: float | None = None, max_batch: int = 32, profile: bool = False,
                 profile_steps: int = 3, prefill_threads: int | None = None, headroom: int = HEADROOM_TOKENS,
                 spill_dir=None, reuse_prefill: bool = False, log=None, on_partial=None) -> dict:
    """``kvkit bench --batch``: the full cache and every ``(policy, options)`` of ``configs`` on the same
    left-padded batch of ``batch`` essay passages of ``length`` tokens, decoded at each thread count of ``threads``.
    Returns ``{"rows": [...], "fits": [...], "memory": [...], "profile": {...}, ...}``.

    One exact prefill is recorded (spilled to a memory-mapped temp file) and replayed into each policy's cache
    (:mod:`kvkit.workloads.shared_prefill`; policies without an exact prefill run their own). Each policy is then
    measured against a fresh full cache in interleaved rounds (round k: full and the policy each decode ``steps``
    timed steps, which goes first alternating), so only two caches are alive at a time and each speed-up is a
    ratio of medians taken under the same load. The ``full`` row holds the full cache's steps over all pairs.
    ``spill_dir`` / ``reuse_prefill``: see :func:`record_prefill_spilled` (``kvkit bench --prefill-cache DIR``).
    ``on_partial(result)``: called after each pair with the rows so far (the CLI writes them, so an interrupted
    run keeps what it measured).

    ``memory_gib``: also, for each policy, the largest batch whose KV (held bytes per sequence at ``length``,
    measured here, plus ``headroom`` tokens of uncompressed K/V) fits in that many GiB, and the decode throughput
    at ``min(that batch, max_batch)`` against the full cache at its own fit batch (prompts replayed with rows
    repeated; interleaved pairs again). ``profile``: ``torch.profiler`` top ops of ``profile_steps`` decode steps
    per policy (at the first thread count)."""
    threads = _check_args(batch, length, rounds, steps, threads, memory_gib, max_batch)
    configs = check_configs(configs)
    decoded = decoded_tokens(len(threads), rounds, steps, profile, profile_steps)
    check_length(model, length + decoded, "--lengths (+ the decoded tokens)")

    threads0 = torch.get_num_threads()
    weights = weight_bytes(model)
    ids, mask = batch_prompts(tokenizer, batch, length)
    s = _Setup(model=model, ids=ids, mask=mask, rec=None, threads=threads, rounds=rounds, steps=steps,
               pthreads=prefill_threads or max(threads), weights=weights, length=length,
               log=log or (lambda *a: None))
    result = dict(batch=batch, length=length, threads=threads, rounds=rounds, steps=steps, weights=weights,
                  real_tokens=int(mask.sum()), padded_tokens=int(mask.numel() - mask.sum()), pairwise=True)
    try:
        torch.set_num_threads(s.pthreads)
        if any(replayable(n, o) for n, o in configs):
            s.rec = _record(s, spill_dir, reuse_prefill)
            gc.collect()
            result["record_prefill_s"] = round(s.rec.seconds, 2)
            result["prefill_reused"] = s.rec.reused
        rows, prof, held, full_run = _pairs(s, configs, profile, profile_steps, result, on_partial)
        frows = _full_rows(s, full_run, pairs=len(configs) - 1)
        result["rows"] = sorted(frows + rows, key=lambda x: (x["threads"], x["label"] != "full"))
        if profile:
            result["profile"] = prof
            result["profile_threads"] = threads[0]
        del full_run
        gc.collect()
        if memory_gib is not None:
            result.update(_memory(s, configs, held, memory_gib, max_batch, headroom, result, on_partial))
    finally:
        s.rec = None
        torch.set_num_threads(threads0)
    return result


def _check_args(batch, length, rounds, steps, threads, memory_gib, max_batch) -> list[int]:
    """``ValueError`` naming the flag for any bad argument of :func:`decode_bench`; returns the thread counts."""
    positive_int(batch, "--batch")
    positive_int(length, "--lengths")
    positive_int(rounds, "--rounds")
    positive_int(steps, "--steps")
    threads = [positive_int(t, "--threads") for t in threads]
    if not threads:
        raise ValueError("--threads needs at least one thread count")
    if memory_gib is not None:
        if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or not memory_gib > 0:
            raise ValueError(f"--memory must be a positive number of GiB, got {memory_gib!r}")
        positive_int(max_batch, "--max-batch")
    return threads


def _record(s: _Setup, spill_dir, reuse: bool):
    """The batch's exact prefill, recorded through the full cache and spilled (:func:`record_prefill_spilled`)."""
    kvkit.patch(s.model, "full")
    try:
        s.log(f"recording one exact prefill of {s.ids.shape[0]} x {s.length} ...")
        return record_prefill_spilled(s.model, s.ids, s.mask, spill_dir, reuse=reuse)
    finally:
        kvkit.unpatch(s.model)


def _pairs(s: _Setup, configs, profile: bool, profile_steps: int, result: dict, on_partial):
    """Each policy of ``configs[1:]`` (or full alone) timed against a fresh full cache, and profiled with
    ``profile``. Returns ``(policy rows, profiles, held, full_run)``: ``held`` maps each label to its KV bytes
    per sequence ``(held, offloaded)``; ``full_run`` carries the full cache's steps over all pairs and, in place
    of its cache, the read bytes of the first pair's."""
    rows, prof, held = [], {}, {}
    full_times = {t: [] for t in s.threads}
    full_cpu = {t: [] for t in s.threads}
    full_run = None
    bar = progress(total=len(configs), desc=f"decode {s.ids.shape[0]}x{s.length}")
    for k, (name, opts) in enumerate(configs[1:] or [("full", {})]):
        full, r = _timed_pair(s, k, name, opts)
        for t in s.threads:
            full_times[t] += full.times[t]
            full_cpu[t] += full.cpu[t]
        if r is not full:
            rows += [x for x in pair_rows(full, r, s.threads, s.weights, s.length) if x["label"] != "full"]
        if k == 0:  # the full row: its steps over all pairs, its bytes from the first (no cache kept)
            full_run = _cacheless(full)
        held[config_label(r.name, r.options)] = (r.kv_held / r.batch, r.kv_offloaded / r.batch)
        held["full"] = (full.kv_held / full.batch, 0.0)
        if profile:
            torch.set_num_threads(s.threads[0])
            s.log(f"profiling {config_label(name, opts)} ...")
            prof.update(profile_runs(s.model, [full, r] if k == 0 and r is not full else [r], steps=profile_steps))
        if on_partial is not None and r is not full:
            on_partial(dict(result, rows=list(rows), profile=dict(prof), partial=True))
        del full, r
        gc.collect()
        bar.update(1)
    bar.close()
    full_run.times, full_run.cpu = full_times, full_cpu
    return rows, prof, held, full_run


def _timed_pair(s: _Setup, k: int, name: str, opts: dict) -> tuple[DecodeRun, DecodeRun]:
    """A fresh full cache and ``name`` (the same run when ``name`` is full), prefilled and decoded in interleaved
    rounds, the full cache first when ``k`` is even. Returns ``(full, run)``."""
    torch.set_num_threads(s.pthreads)
    s.log(f"prefill full + {config_label(name, opts)} ...")
    full = prefill_run(s.model, "full", {}, s.ids, s.mask, s.rec)
    r = prefill_run(s.model, name, opts, s.ids, s.mask, s.rec) if (name, opts) != ("full", {}) else full
    pair = [full, r] if r is not full else [full]
    decode_rounds(s.model, pair if k % 2 == 0 else pair[::-1], s.threads, s.rounds, s.steps)
    return full, r


def _cacheless(run: DecodeRun) -> DecodeRun:
    """A copy of ``run`` that keeps no cache (only its read bytes per step) and no decode state."""
    read = int(run.cache.read_nbytes())
    return dataclasses.replace(run, cache=types.SimpleNamespace(read_nbytes=lambda v=read: v),
                               nxt=None, mask=None, pos=None)


def _full_rows(s: _Setup, full_run: DecodeRun, pairs: int) -> list[dict]:
    """The full cache's rows (one per thread count) over all ``pairs``: the baseline of every ratio."""
    frows = step_rows([full_run], s.threads, s.weights, s.length)
    for x in frows:
        x.update(speedup=1.0, bound=1.0, fraction=None, kv_held_vs_full=1.0, kv_read_vs_full=1.0, cpu_speedup=1.0,
                 cpu_fraction=None,
                 full_step_ms=x["step_ms"], full_tok_s=x["tok_s"], full_batch=x["batch"], pairs=pairs)
    return frows


def _memory(s: _Setup, configs, held: dict, memory_gib: float, max_batch: int, headroom: int, result: dict,
            on_partial) -> dict:
    """``--memory``: each policy's fit batch in ``memory_gib`` (:func:`_fits`) and the decode throughput of each
    policy at ``min(fit, max_batch)`` against full at its own (:func:`_memory_pairs`). Returns the result's
    ``memory_gib``, ``max_batch``, ``headroom_tokens``, ``fits`` and ``memory`` entries."""
    fits = _fits(configs, held, memory_gib * 2**30, headroom * full_token_bytes(s.model), max_batch)
    by_label = {f["label"]: f for f in fits}
    mrows = _memory_pairs(s, fits, by_label["full"]["measured_batch"], result, on_partial)
    for x in mrows:
        f = by_label[x["label"]]
        x.update(memory_gib=memory_gib, fit_batch=f["fit_batch"], fit_batch_with_offloaded=f["fit_batch_with_offloaded"],
                 headroom_per_seq=f["headroom_per_seq"], capped=f["fit_batch"] > max_batch)
        for key in ("speedup", "bound", "fraction", "kv_held_vs_full", "kv_read_vs_full"):
            x.pop(key, None)
    full_fit = by_label["full"]["fit_batch"] or 1
    for f in fits:
        f["fit_vs_full"] = round(f["fit_batch"] / full_fit, 3)
        f["held_ratio"] = round(by_label["full"]["kv_held_per_seq"] / max(1, f["kv_held_per_seq"]), 3)
    return dict(memory_gib=memory_gib, max_batch=max_batch, headroom_tokens=headroom, fits=fits, memory=mrows)


def _fits(configs, held: dict, mem: float, head: int, max_batch: int) -> list[dict]:
    """One entry per config: its KV bytes per sequence, the largest batch that fits in ``mem`` bytes with ``head``
    bytes of headroom per sequence (also counting offloaded bytes), and the batch it is measured at."""
    fits = []
    for name, opts in configs:
        label = config_label(name, opts)
        h, off = held[label]
        fit = memory_fit(mem, h, head)
        fits.append(dict(policy=name, options=opts, label=label, kv_held_per_seq=int(h),
                         headroom_per_seq=int(head), kv_offloaded_per_seq=int(off), fit_batch=fit,
                         fit_batch_with_offloaded=memory_fit(mem, h + off, head),
                         measured_batch=min(fit, max_batch)))
    return fits


def _memory_pairs(s: _Setup, fits: list[dict], full_batch: int, result: dict, on_partial) -> list[dict]:
    """One policy at a time at its measured batch against a fresh full cache at ``full_batch`` (prompt rows
    repeated), interleaved; the full rows name the policy they were ``paired_with``."""
    mrows = []
    for k, f in enumerate(fits[1:]):
        if f["measured_batch"] < 1 or full_batch < 1:
            continue
        torch.set_num_threads(s.pthreads)
        s.log(f"prefill full at batch {full_batch} + {f['label']} at batch {f['measured_batch']} ...")
        mfull = prefill_run(s.model, "full", {}, s.ids, s.mask, s.rec, batch=full_batch)
        r = prefill_run(s.model, f["policy"], f["options"], s.ids, s.mask, s.rec, batch=f["measured_batch"])
        decode_rounds(s.model, [mfull, r] if k % 2 == 0 else [r, mfull], s.threads, s.rounds, s.steps)
        pair = pair_rows(mfull, r, s.threads, s.weights, s.length)
        for x in pair:
            if x["label"] == "full":
                x["paired_with"] = f["label"]
        mrows += pair
        del mfull, r
        gc.collect()
        if on_partial is not None:
            on_partial(dict(result, memory_partial=list(mrows), fits=fits, partial=True))
    return mrows
