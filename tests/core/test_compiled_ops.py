"""Operators per compiled decode step stay pinned: a step that grows shows here, without a GPU.

A static decode step of a 2-layer tiny Llama is compiled (``fullgraph=True``, a recording backend,
:func:`kvkit.evals.gpu.ops.count_step_ops`) for ``full`` and the two policies that matter most on a GPU
(``streaming`` and ``snapkv``: the policies that beat compiled ``full``), on the GPU's kernel path (Triton, here
under the interpreter) and on the torch reference path; the aten operators, the non-view (``compute``) ones and
the fused ``kvkit::*`` operators of the one captured graph are compared with the pinned counts of
:data:`PINNED` (the table of every policy, per layer and per step: ``results/speed-gpu/ops-per-step.md``).
A change that lowers a count should lower its pin too.
"""

import importlib.util
import os
import sys

import pytest

import kvkit  # noqa: F401  (loads kvkit.patch)
from kvkit.evals.gpu.ops import count_step_ops
from kvkit.testing import policy_test_options, tiny_model

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LAYERS = 2

#: (kernels path, policy) -> (aten, compute) operators of one compiled step of the 2-layer tiny Llama
PINNED = {
    ("triton", "full"): (211, 114),
    ("triton", "streaming"): (235, 141),
    ("triton", "snapkv"): (217, 131),
    ("reference", "full"): (209, 116),
    ("reference", "streaming"): (261, 153),
    ("reference", "snapkv"): (247, 145),
}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


@pytest.mark.parametrize("kernels,policy", list(PINNED))
def test_compiled_step_operator_count_stays_within_its_pin(kernels, policy):
    if kernels == "triton" and not (HAS_TRITON and INTERPRET):
        pytest.skip("the Triton path on the CPU needs triton and TRITON_INTERPRET=1")
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    r = count_step_ops(model, policy, policy_test_options(policy, LAYERS), kernels=kernels)
    aten, compute = PINNED[kernels, policy]
    assert r["graphs"] == 1  # the whole step, one graph
    assert r["aten"] <= aten and r["compute"] <= compute, (
        f"{policy} ({kernels}): {r['aten']} aten / {r['compute']} compute operators per step, pinned at "
        f"{aten} / {compute}; per layer ~{r['aten'] / LAYERS:.0f}. Most frequent: {r['top']}")
    # the GPU path reads every layer's slots through one fused operator; the reference path has none
    assert r["custom"] == (LAYERS if kernels == "triton" else 0)
    assert r["torch"] > 0 and r["compute"] < r["aten"]


def test_operator_counter_sees_a_step_that_grows():
    """The counter counts what the step runs: one more operator per layer in the attention shows as one more
    compute operator per layer."""
    patch_module = sys.modules["kvkit.patch"]  # kvkit.patch (the attribute) is the function
    inner = patch_module.kvkit_attention
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    base = count_step_ops(model, "full", kernels="reference")

    def grown(module, query, *args, **kwargs):
        out, w = inner(module, query, *args, **kwargs)
        return out * 1.0, w

    patch_module.kvkit_attention = grown  # registered under "kvkit" by every patch
    try:
        more = count_step_ops(model, "full", kernels="reference")
    finally:
        patch_module.kvkit_attention = inner
        patch_module._register()
    assert more["compute"] == base["compute"] + LAYERS
