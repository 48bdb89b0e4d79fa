"""The decode seam inside the stores: single-token eager steps of every policy read through
:func:`kvkit.kernels.decode` where the kernels package picks Triton (forced here on CPU tensors with
``KVKIT_KERNELS=triton`` under ``TRITON_INTERPRET=1``), with the same tokens as the SDPA path; a kernel launch that
fails falls back to SDPA with one warning. The backend is picked by :func:`kvkit.kernels.decode` alone: on the CPU default
path it hands every store's read back (returns None) and the store's SDPA path runs."""

import warnings

import pytest
import torch

import kvkit
from kvkit import kernels
from kvkit.kernels import dispatch, seam
from kvkit.testing import greedy, left_padded_batch, policy_test_options, tiny_model

POLICIES = kvkit.available_policies()


def _run(policy, lengths, steps=4):
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch(lengths, seed=5)
    kvkit.patch(model, policy, **policy_test_options(policy))
    try:
        toks, logits, _ = greedy(model, ids, steps, attention_mask=mask if len(lengths) > 1 else None)
    finally:
        kvkit.unpatch(model)
    return toks, torch.stack(logits, 1)


@pytest.fixture
def count_seam(monkeypatch):
    calls = []
    real = kernels.decode

    def counted(q, view, **kw):  # the reads a kernel served (None: handed back to the store's own path)
        r = real(q, view, **kw)
        if r is not None:
            calls.append(view() if callable(view) else view)
        return r

    monkeypatch.setattr(kernels, "decode", counted)
    monkeypatch.setattr(dispatch, "_LAUNCH", {"failed": None})
    return calls


@pytest.mark.parametrize("lengths", [(40,), (40, 27)], ids=["single", "left-padded"])
@pytest.mark.parametrize("policy", POLICIES)
def test_triton_seam_gives_the_sdpa_tokens(policy, lengths, monkeypatch, count_seam):
    ref_toks, ref_logits = _run(policy, lengths)
    assert not count_seam  # the CPU default path does not take the seam
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    toks, logits = _run(policy, lengths)
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(logits, ref_logits, rtol=2e-4, atol=2e-4)
    if policy in ("full", "streaming", "snapkv", "duo", "cake", "tidal", "chelsea", "kvzip"):
        assert count_seam, f"{policy}: no decode step went through kvkit.kernels.decode"


def test_failed_launch_falls_back_to_sdpa_once(monkeypatch):
    ref_toks, _ = _run("streaming", (40,))
    monkeypatch.setattr(dispatch, "_LAUNCH", {"failed": None})
    monkeypatch.setenv("KVKIT_KERNELS", "triton")

    def broken(*a, **k):
        raise RuntimeError("no such PTX target")

    monkeypatch.setattr(seam, "_launch", broken)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        toks, _ = _run("streaming", (40,))
    assert torch.equal(toks, ref_toks)
    msgs = [str(x.message) for x in w if "fused decode kernel failed" in str(x.message)]
    assert len(msgs) == 1 and "no such PTX target" in msgs[0]
    assert dispatch.launch_failed()


@pytest.mark.parametrize("lengths", [(40,), (40, 27)], ids=["single", "left-padded"])
def test_zipcache_step_is_one_seam_call_per_layer(lengths, monkeypatch, count_seam):
    """A ZipCache decode step on the Triton path reads the tail and every packed segment in ONE
    kernels.decode call per layer (tail as the view's own keys, segments as PackedParts), no quant_decode."""
    from kvkit.kernels.view import PackedPart
    from kvkit.stores import quantized

    ref_toks, ref_logits = _run("zipcache", lengths)
    monkeypatch.setenv("KVKIT_KERNELS", "triton")
    quant_calls, steps = [], []
    real_qd, real_decode = quantized.quant_decode, quantized.QuantizedSegmentStore.decode

    def counted_qd(*a, **k):
        quant_calls.append(1)
        return real_qd(*a, **k)

    def counted_decode(self, query, qpos, scaling):
        if query.shape[2] == 1:
            steps.append(len(count_seam))
        out = real_decode(self, query, qpos, scaling)
        if query.shape[2] == 1:
            assert len(count_seam) == steps[-1] + 1, "a zipcache step must be exactly one kernels.decode call"
        return out

    monkeypatch.setattr(quantized, "quant_decode", counted_qd)
    monkeypatch.setattr(quantized.QuantizedSegmentStore, "decode", counted_decode)
    toks, logits = _run("zipcache", lengths)
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(logits, ref_logits, rtol=2e-4, atol=2e-4)
    assert steps and len(count_seam) == len(steps)  # one call per layer per step, nothing else
    assert not quant_calls
    assert all(v.parts and all(isinstance(p, PackedPart) for p in v.parts) for v in count_seam)
