"""``kvkit bench`` (without ``--batch``): prefill time, decode tokens/s, peak memory and ``KVCache.nbytes()`` of
a policy and the full-cache baseline, measured in the same run on the same prompts, one row per (policy, prompt
length, prefill mode).

With ``prefill_chunk`` (``kvkit bench --prefill-chunk N``) the policy and the full cache are also run with
chunked prefill (:func:`kvkit.prefill`, ``N`` tokens per forward) next to the one-shot prefill, so the
peak prefill memory of both modes is measured in the same run; ``*_vs_full`` ratios are always relative
to the full cache with one-shot prefill. Peak memory: :class:`kvkit.evals.bench.memory.PeakMemory`. Absolute
times only mean something on the same machine.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.evals.bench.configs import positive_int
from kvkit.evals.bench.memory import PeakMemory, sync
from kvkit.evals.bench.prompts import batch_prompts, bench_prompt, positions
from kvkit.evals.runner import progress
from kvkit.workloads.prompts import check_length


@dataclass
class BenchRow:
    policy: str
    options: dict
    length: int
    prefill_s: float
    decode_tok_s: float
    decode_tokens: int
    peak_prefill_bytes: int
    peak_decode_bytes: int
    kv_bytes_prefill: int
    kv_bytes_decode: int
    kv_offloaded_bytes: int
    prefill_chunk: int = 0  # 0: one forward over the whole prompt; N: kvkit.prefill in chunks of N tokens
    kv_read_step: int = 0  # K/V bytes the last decode step's attention read (KVCache.read_nbytes)


def bench_one(model, ids, policy: str, options: dict, decode_tokens: int, warmup: bool = True,
              prefill_chunk: int = 0, attention_mask=None) -> BenchRow:
    """Patch, prefill ``ids [B, T]`` (timed; one forward, or :func:`kvkit.prefill` in chunks of
    ``prefill_chunk`` tokens; ``attention_mask`` for a left-padded batch), decode ``decode_tokens`` greedily
    (timed), unpatch."""
    device = model.device
    ids = ids.to(device)
    kvkit.patch(model, policy, **options)
    try:
        with torch.no_grad():
            if warmup:  # kernels / allocator warm-up on a short prompt
                c = kvkit.KVCache(model, prompt_length=ids[:, -64:].shape[1])
                model(input_ids=ids[:, -64:], **cache_kw(c), use_cache=True)
                del c
            mask = kw = None
            if attention_mask is not None:
                mask = attention_mask.to(device)
                kw = dict(attention_mask=mask, position_ids=positions(mask))
            # a static cache resolves a compression_ratio for its first forward: the prompt, or its first chunk
            first = min(ids.shape[1], prefill_chunk) if prefill_chunk else ids.shape[1]
            cache = kvkit.KVCache(model, prompt_length=first)
            with PeakMemory(device) as mp:
                sync(device)
                t0 = time.perf_counter()
                if prefill_chunk:
                    cache, last = kvkit.prefill(model, ids, attention_mask=mask, chunk_size=prefill_chunk, cache=cache)
                else:
                    last = model(input_ids=ids, **cache_kw(cache), use_cache=True, logits_to_keep=1,
                                 **(kw or {})).logits[:, -1]
                sync(device)
                prefill = time.perf_counter() - t0
            kv_prefill = cache.nbytes()
            nxt = last.argmax(-1, keepdim=True)
            del last
            pos = positions(mask)[:, -1:] if mask is not None else None
            with PeakMemory(device) as md:
                sync(device)
                t0 = time.perf_counter()
                for _ in range(decode_tokens):
                    kw = {}
                    if mask is not None:
                        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                        pos = pos + 1
                        kw = dict(attention_mask=mask, position_ids=pos)
                    out = model(input_ids=nxt, **cache_kw(cache), use_cache=True, **kw)
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                sync(device)
                decode = time.perf_counter() - t0
        return BenchRow(
            policy=policy, options=dict(options), length=int(ids.shape[1]), prefill_s=round(prefill, 4),
            decode_tok_s=round(decode_tokens / max(decode, 1e-9), 2), decode_tokens=decode_tokens,
            peak_prefill_bytes=int(mp.peak), peak_decode_bytes=int(md.peak), kv_bytes_prefill=int(kv_prefill),
            kv_bytes_decode=int(cache.nbytes()), kv_offloaded_bytes=int(cache.offloaded_nbytes()),
            prefill_chunk=int(prefill_chunk or 0), kv_read_step=int(cache.read_nbytes()),
        )
    finally:
        kvkit.unpatch(model)


def run(model, tokenizer, policy: str, options: dict, lengths: list[int], decode_tokens: int = 32,
        prefill_chunk: int | None = None, more: list | None = None, batch: int = 1,
        oneshot: str = "all") -> list[dict]:
    """Rows for the full cache and ``policy`` at each length (one-shot prefill; with ``prefill_chunk`` also
    chunked prefill of both). ``more``: further ``(policy, options)`` pairs measured in the same run, on the
    same prompts, against the same full-cache rows. ``batch > 1``: a left-padded batch of essay passages
    (:func:`batch_prompts`). ``oneshot="full"``: with ``prefill_chunk``, only the full cache also runs the
    one-shot prefill (the baseline of every ratio; the policies only the chunked one)."""
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk <= 0):
        raise ValueError(f"--prefill-chunk must be a positive number of tokens, got {prefill_chunk!r}")
    if oneshot not in ("all", "full"):
        raise ValueError(f"--oneshot must be 'all' or 'full', got {oneshot!r}")
    positive_int(batch, "--batch")
    for L in lengths:
        check_length(model, L + decode_tokens, f"--lengths {L} + --decode-tokens {decode_tokens} =")
    rows = []
    configs = [("full", {})] + ([] if policy == "full" else [(policy, options)])
    for name, opts in more or []:
        if (name, opts) not in configs:
            configs.append((name, opts))
    modes = [0] + ([prefill_chunk] if prefill_chunk else [])
    todo = [(chunk, name, opts) for chunk in modes for name, opts in configs
            if chunk or oneshot == "all" or not prefill_chunk or name == "full"]
    bar = progress(total=len(lengths) * len(todo), desc="bench")
    for L in lengths:
        mask = None
        if batch > 1:
            ids, mask = batch_prompts(tokenizer, batch, L)
        else:
            ids = bench_prompt(tokenizer, L)
        for chunk, name, opts in todo:
            row = asdict(bench_one(model, ids, name, opts, decode_tokens, prefill_chunk=chunk, attention_mask=mask))
            row["batch"] = int(ids.shape[0])
            rows.append(row)
            bar.update(1)
    bar.close()
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Add ``*_vs_full`` ratios (policy / full) to each row."""
    full = {r["length"]: r for r in rows if r["policy"] == "full" and not r.get("prefill_chunk")}
    for r in rows:
        f = full.get(r["length"])
        if f is None:
            continue
        for k in ("prefill_s", "decode_tok_s", "peak_prefill_bytes", "peak_decode_bytes", "kv_bytes_prefill",
                  "kv_bytes_decode", "kv_read_step"):
            r[f"{k}_vs_full"] = round(r[k] / f[k], 4) if f[k] else None
    return rows
