"""``kvkit bench``: prefill time, decode tokens/s, peak memory and ``KVCache.nbytes()`` for a policy
and the full-cache baseline, measured in the same run on the same prompts.

With ``prefill_chunk`` (``kvkit bench --prefill-chunk N``) the policy and the full cache are also run with
chunked prefill (:func:`kvkit.prefill`, ``N`` tokens per forward) next to the one-shot prefill, so the
peak prefill memory of both modes is measured in the same run; ``*_vs_full`` ratios are always relative
to the full cache with one-shot prefill.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (reset before each phase); on CPU the peak
resident-set size above the level before the phase, sampled every few milliseconds (torch's CPU
allocator is invisible to tracemalloc). Absolute times only mean something on the same machine.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Context manager: peak memory above the start level during the block (bytes)."""

    def __init__(self, device):
        self.cuda = str(device).startswith("cuda")
        self.peak = 0

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _rss()
            self._max = self.base
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self._max = max(self._max, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, _rss()) - self.base
        return False


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


def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def bench_one(model, ids, policy: str, options: dict, decode_tokens: int, warmup: bool = True,
              prefill_chunk: int = 0) -> BenchRow:
    """Patch, prefill ``ids [1, T]`` (timed; one forward, or :func:`kvkit.prefill` in chunks of
    ``prefill_chunk`` tokens), decode ``decode_tokens`` greedily (timed), unpatch."""
    import torch

    import kvkit

    device = model.device
    ids = ids.to(device)
    kvkit.patch(model, policy, **options)
    try:
        with torch.no_grad():
            if warmup:  # kernels / allocator warm-up on a short prompt
                c = kvkit.KVCache(model)
                model(input_ids=ids[:, :64], past_key_values=c, use_cache=True)
                del c
            cache = kvkit.KVCache(model)
            with PeakMemory(device) as mp:
                _sync(device)
                t0 = time.perf_counter()
                if prefill_chunk:
                    cache, last = kvkit.prefill(model, ids, chunk_size=prefill_chunk, cache=cache)
                else:
                    last = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
                _sync(device)
                prefill = time.perf_counter() - t0
            kv_prefill = cache.nbytes()
            nxt = last.argmax(-1, keepdim=True)
            del last
            with PeakMemory(device) as md:
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(decode_tokens):
                    out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                _sync(device)
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


def bench_prompt(tokenizer, length: int):
    """``[1, length]`` token ids of Paul Graham essays (the RULER haystack)."""
    import torch

    from kvkit.evals.ruler import essay_words

    words = essay_words()
    ids: list[int] = []
    n = length
    while len(ids) < length:
        ids = tokenizer(" ".join(words[:n]), add_special_tokens=False)["input_ids"]
        n *= 2
    return torch.tensor([ids[:length]], dtype=torch.long)


def run(model, tokenizer, policy: str, options: dict, lengths: list[int], decode_tokens: int = 32,
        prefill_chunk: int | None = None, more: list | None = None) -> list[dict]:
    """Rows for the full cache and ``policy`` at each length (one-shot prefill; with ``prefill_chunk`` also
    chunked prefill of both). ``more``: further ``(policy, options)`` pairs measured in the same run, on the
    same prompts, against the same full-cache rows."""
    from kvkit.evals.common import check_length, progress

    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk <= 0):
        raise ValueError(f"--prefill-chunk must be a positive number of tokens, got {prefill_chunk!r}")
    for L in lengths:
        check_length(model, L + decode_tokens, "--lengths")
    rows = []
    configs = [("full", {})] + ([] if policy == "full" else [(policy, options)])
    for name, opts in more or []:
        if (name, opts) not in configs:
            configs.append((name, opts))
    modes = [0] + ([prefill_chunk] if prefill_chunk else [])
    bar = progress(total=len(lengths) * len(configs) * len(modes), desc="bench")
    for L in lengths:
        ids = bench_prompt(tokenizer, L)
        for chunk in modes:
            for name, opts in configs:
                rows.append(asdict(bench_one(model, ids, name, opts, decode_tokens, prefill_chunk=chunk)))
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
