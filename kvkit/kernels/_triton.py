"""Lazy, optional Triton import.

kvkit imports without Triton; the kernel modules (``sparse``, ``weighted``, ``quant_attn``, ``lowrank``,
``fused_decode`` and their shared ``splitk``) define their ``@triton.jit`` functions at import time, so they are
imported only when a Triton launch is actually requested (see :func:`kvkit.kernels.use_triton`).
"""

from __future__ import annotations

import functools
import os

import torch

_AVAILABLE: list[bool] = []


@torch.compiler.assume_constant_result  # a compiled step calls it once while tracing, never inside the graph
def triton_available() -> bool:
    """Whether Triton imports (checked once per process)."""
    if not _AVAILABLE:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _AVAILABLE.append(True)
        except Exception:  # ImportError, or a broken install (missing CUDA libs, ...)
            _AVAILABLE.append(False)
    return _AVAILABLE[0]


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton():
    if not triton_available():
        raise ImportError(
            "kvkit's Triton kernels need the 'triton' package (pip install 'kvkit[triton]'); "
            "unset KVKIT_KERNELS=triton to use the torch reference path instead"
        )
    import triton

    return triton


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of a CUDA device (used to size split-K); 4 under the interpreter."""
    import torch

    if interpreting() or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count
