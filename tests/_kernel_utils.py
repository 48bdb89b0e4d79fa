"""Helpers shared by the kernel tests (not a test module)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
# Triton decides at @triton.jit time whether kernels are interpreted, so one pytest process runs either the
# interpreter tests (TRITON_INTERPRET=1, set by conftest.py: CPU tensors) or the CUDA ones (TRITON_INTERPRET=0).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_triton = pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                                  reason="needs triton (pip install 'kvkit[triton]') and TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON and not INTERPRET),
                                reason="needs a CUDA GPU, triton and TRITON_INTERPRET=0")


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def assert_flash_rule(kernel, lowp, truth, atol=1e-5, name=""):
    """Flash-attention tolerance: kernel vs fp64 error <= 2x the low-precision torch reference's + atol.

    atol adds half an ulp of the output dtype at the output's magnitude: rounding the exact result to
    bf16 costs that much, and on tiny outputs the reference's max error can land below it by luck."""
    e_k, e_r = max_err(kernel, truth), max_err(lowp, truth)
    if kernel.is_floating_point():
        atol = atol + 0.5 * torch.finfo(kernel.dtype).eps * truth.abs().max().item()
    assert torch.isfinite(kernel.float()).all(), f"{name}: non-finite values"
    assert e_k <= 2 * e_r + atol, f"{name}: kernel error {e_k:.3e} > 2 x reference error {e_r:.3e} + {atol}"
