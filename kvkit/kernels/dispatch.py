"""Which path a kernel call runs: the one place kvkit picks between its Triton kernels and the torch/C paths.

``KVKIT_KERNELS`` = ``auto`` (default: Triton for CUDA tensors when Triton imports, else the torch/C paths),
``reference`` (never Triton) or ``triton`` (always; on CPU tensors that needs ``TRITON_INTERPRET=1``, which the tests
set). Triton is imported only when a Triton kernel is about to run. A fused decode launch that raises (a Triton
build the device cannot compile) is recorded once (:func:`launch_failed`) with one warning, and
:func:`kvkit.kernels.decode` serves the process without Triton from then on.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from kvkit import env

from ._triton import require_triton, triton_available

#: the first exception of a fused decode launch (then the torch path serves the process)
_LAUNCH = {"failed": None}


def use_triton(*tensors: torch.Tensor) -> bool:
    """Which path runs for these tensors: ``KVKIT_KERNELS`` = auto (default) | reference | triton."""
    mode = env.kernels_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        require_triton()
        return True
    return all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor)) and triton_available()


def on_device(t: torch.Tensor):
    """Launch on ``t``'s GPU: Triton launches on the *current* CUDA device, which need not be the one the
    layer lives on when device_map spreads a model over several GPUs."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def backend(device=None) -> str:
    """Human-readable kernel path for a device (used by ``kvkit doctor``)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if env.kernels_mode() == "reference":
        return "torch reference (KVKIT_KERNELS=reference)"
    if dev.type == "cuda" and triton_available():
        import triton

        return f"triton {triton.__version__}"
    return "torch reference" + ("" if triton_available() else " (triton not installed)")


def launch_failed() -> str | None:
    """The first fused decode launch failure of this process (``"Type: message"``), or None."""
    return _LAUNCH["failed"]


def record_launch_failure(e: Exception) -> None:
    """Record a fused decode launch that raised and say so once: :func:`kvkit.kernels.decode` then runs the torch
    path for the rest of the process."""
    _LAUNCH["failed"] = f"{type(e).__name__}: {e}"
    warnings.warn(f"kvkit: the fused decode kernel failed ({_LAUNCH['failed'][:200]}); decode falls back to "
                  "torch's SDPA for this process", RuntimeWarning, stacklevel=4)
