"""One policy's batched decode: its cache prefilled at a batch size (replayed from a recorded prefill when the
policy's prefill is exact, else its own prefill forward), and single greedy decode steps of the whole batch.

:class:`DecodeRun` holds the state between steps: the cache, the next input tokens ``[B, 1]``, the attention
mask ``[B, T]`` (left padding, one more real token per step) and the positions ``[B, 1]``, plus the step times
the timing rounds append (:mod:`kvkit.evals.bench.timing`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.evals.bench.memory import sync
from kvkit.evals.bench.prompts import positions
from kvkit.evals.bench.replay import replay_rows
from kvkit.workloads.shared_prefill import replayable


@dataclass
class DecodeRun:
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


def prefill_run(model, name, opts, ids, mask, rec=None, batch=None) -> DecodeRun:
    """Patch ``name`` and prefill its cache at ``batch`` rows (rows of ``ids`` repeat when ``batch`` is larger):
    replayed from ``rec`` when the policy's prefill is exact, else its own prefill forward."""
    b0 = ids.shape[0]
    batch = batch or b0
    rows = torch.arange(batch) % b0
    ids_b, mask_b = ids.index_select(0, rows), mask.index_select(0, rows)
    kvkit.patch(model, name, **opts)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            if rec is not None and replayable(kvkit.patched_policy(model)):
                cache, last = replay_rows(model, rec, rows, b0)
                replayed = True
            else:
                cache = kvkit.KVCache(model, prompt_length=ids_b.shape[1])
                last = model(input_ids=ids_b, attention_mask=mask_b, position_ids=positions(mask_b),
                             **cache_kw(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
                replayed = False
        dt = time.perf_counter() - t0
    finally:
        kvkit.unpatch(model)
    return DecodeRun(name=name, options=dict(opts), batch=batch, cache=cache, nxt=last.argmax(-1, keepdim=True),
                     mask=mask_b, pos=positions(mask_b)[:, -1:], prefill_s=dt, replayed=replayed,
                     kv_held=int(cache.nbytes()), kv_offloaded=int(cache.offloaded_nbytes()), times={}, cpu={})


def decode_step(model, r: DecodeRun) -> float:
    """One greedy decode step of the whole batch (patched model); returns its wall time (its process CPU time,
    all threads, goes to ``r.last_cpu``)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    r.mask = torch.cat([r.mask, r.mask.new_ones(r.mask.shape[0], 1)], 1)
    r.pos = r.pos + 1
    out = model(input_ids=r.nxt, attention_mask=r.mask, position_ids=r.pos, **cache_kw(r.cache), use_cache=True)
    r.nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(r.nxt.device)
    dt = time.perf_counter() - t0
    r.last_cpu = time.process_time() - c0
    return dt
