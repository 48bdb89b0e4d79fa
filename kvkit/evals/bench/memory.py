"""Peak memory of a block of work, and the device synchronisation every timed phase ends with.

On CUDA :class:`PeakMemory` reads ``torch.cuda.max_memory_allocated`` (reset before the block); on CPU it samples
the resident-set size every few milliseconds (torch's CPU allocator is invisible to tracemalloc), after handing
freed pages back to the OS (``malloc_trim``) so that the level before the block is the memory in use. Both report
bytes above the level at the start of the block.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time

import torch


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
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, _rss()) - self.base
        return False


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
