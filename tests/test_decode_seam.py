"""The decode seam inside the stores: single-token eager steps of every policy read through
:func:`kvkit.kernels.decode` where the kernels package picks Triton (forced here on CPU tensors with
``KVKIT_KERNELS=triton`` under ``TRITON_INTERPRET=1``), with the same tokens as the SDPA path; a kernel launch that
fails falls back to SDPA with one warning."""

import warnings

import pytest
import torch

import kvkit
from kvkit import kernels
from kvkit.registry import policy_class
from kvkit.stores import attend
from kvkit.testing import greedy, left_padded_batch, tiny_model

POLICIES = kvkit.available_policies()


def _opts(policy, layers=3):
    opts = dict(policy_class(policy).test_options)
    if "pattern" in opts:
        opts["pattern"] = [opts["pattern"][i % len(opts["pattern"])] for i in range(layers)]
    return opts


def _run(policy, lengths, steps=4):
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch(lengths, seed=5)
    kvkit.patch(model, policy, **_opts(policy))
    try:
        toks, logits, _ = greedy(model, ids, steps, attention_mask=mask if len(lengths) > 1 else None)
    finally:
        kvkit.unpatch(model)
    return toks, torch.stack(logits, 1)


@pytest.fixture
def count_seam(monkeypatch):
    calls = []
    real = kernels.decode

    def counted(q, view, **kw):
        calls.append(view)
        return real(q, view, **kw)

    monkeypatch.setattr(kernels, "decode", counted)
    monkeypatch.setattr(attend, "_SEAM", {"failed": None})
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
    monkeypatch.setattr(attend, "_SEAM", {"failed": None})
    monkeypatch.setenv("KVKIT_KERNELS", "triton")

    def broken(*a, **k):
        raise RuntimeError("no such PTX target")

    monkeypatch.setattr(kernels, "decode", broken)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        toks, _ = _run("streaming", (40,))
    assert torch.equal(toks, ref_toks)
    msgs = [str(x.message) for x in w if "fused decode kernel failed" in str(x.message)]
    assert len(msgs) == 1 and "no such PTX target" in msgs[0]
    assert attend._SEAM["failed"]
