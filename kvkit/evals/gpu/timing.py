"""How a shaped-model bench times and watches decode steps, and the device's copy bandwidth.

Timing (:func:`time_block`): on CUDA each step sits between two CUDA events, with ``torch.cuda.synchronize()``
before and after a block of steps and none between steps, so a step that keeps the device busy is timed as its
device time and one that waits on the host as the wall time between its launches; on the CPU ``time.perf_counter``
around each step. Reported per row: the median step and its 10th / 90th percentiles (:func:`percentile`, linear
interpolation).

Bandwidth (:func:`measure_bandwidth`): a large device-to-device copy (1 GiB on CUDA, less when memory is short;
64 MiB on the CPU) timed ``reps`` times after a warm-up: (bytes read + bytes written) / median copy time.

:class:`StepWatch`: a :class:`kvkit.hostsync.HostSyncCounter` around one extra step that also records which fused
attention ops it dispatched (which sdpa backend ran).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import traceback
from collections import Counter

import torch

from kvkit.hostsync import HostSyncCounter, _is_sync


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def time_block(step, n: int, cuda: bool) -> list[float]:
    """Run ``step`` ``n`` times; seconds of each (CUDA events around each step, one synchronisation before and
    after the block; on the CPU ``perf_counter``)."""
    sync(cuda)
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            s.record()
            step()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in ev]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def percentile(xs: list[float], q: float) -> float:
    """``q``-quantile (linear interpolation) of ``xs``."""
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def step_stats(times: list[float], key: str) -> dict:
    """``{key}_ms`` (median), ``_p10``, ``_p90``, ``_mean`` in milliseconds and ``steps`` of ``times`` (seconds)."""
    ms = [x * 1e3 for x in times]
    return {f"{key}_ms": round(statistics.median(ms), 4), f"{key}_ms_p10": round(percentile(ms, 0.1), 4),
            f"{key}_ms_p90": round(percentile(ms, 0.9), 4), f"{key}_ms_mean": round(sum(ms) / len(ms), 4),
            "steps": len(ms)}


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure_bandwidth(device, nbytes: int | None = None, reps: int = 10) -> dict:
    """Copy bandwidth of ``device``: a ``nbytes`` buffer copied ``reps`` times after a warm-up, (bytes read +
    bytes written) / median copy time. Default size: 1 GiB on CUDA (less when memory is short), 64 MiB on the CPU."""
    cuda = torch.device(device).type == "cuda"
    if nbytes is None:
        nbytes = 64 << 20
        if cuda:
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            nbytes = int(min(1 << 30, free // 8)) // 4096 * 4096
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = statistics.median(time_block(lambda: dst.copy_(src), reps, cuda))
    return dict(bandwidth=2 * nbytes / t, copy_bytes=nbytes, copy_ms=round(t * 1e3, 4), reps=reps)


class StepWatch(HostSyncCounter):
    """:class:`HostSyncCounter` that also records the fused attention ops dispatched (which sdpa backend ran)."""

    ATTN = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")

    def __init__(self):
        super().__init__()
        self.attn_ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if any(a in name for a in self.ATTN):
            self.attn_ops[name.lstrip("_")] += 1
        if _is_sync(func, args, kwargs):
            self.calls.append((str(func), _watch_caller()))
        return func(*args, **kwargs)


def _watch_caller() -> str:
    """file:line of the innermost frame outside torch and the counters (as :func:`kvkit.hostsync._caller`)."""
    for fr in reversed(traceback.extract_stack()[:-1]):
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or f.endswith("hostsync.py") or fr.name in ("__torch_dispatch__", "_watch_caller"):
            continue
        return f"{f.split('/site-packages/')[-1].split('/work/main/')[-1]}:{fr.lineno}"
    return "?"
