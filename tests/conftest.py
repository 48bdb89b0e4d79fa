"""Shared test fixtures: tiny random models of several architectures and the bundled real model."""

import os

# Triton kernels run under the interpreter on CPU; must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

from kvkit.testing import tiny_model  # noqa: E402,F401


@pytest.fixture(scope="session")
def default_model():
    """The bundled SmolLM2-135M-Instruct (loaded once per session)."""
    from kvkit.models import load_default

    return load_default()
