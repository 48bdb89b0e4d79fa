"""A decode step makes no host synchronisation beyond unpatched transformers' own (the GPU decode rule, checked on
the CPU with :class:`kvkit.hostsync.HostSyncCounter`), for every registered policy; compression events may
synchronise (they are told apart by a layer's ``committed`` point moving)."""

import pytest
import torch

import kvkit
from kvkit.hostsync import HostSyncCounter
from kvkit.testing import decode_step_syncs, policy_test_options, tiny_model

POLICIES = kvkit.available_policies()
STEPS = 12


@pytest.mark.parametrize("lengths", [(90, 70), (80,)], ids=["left-padded", "single"])
@pytest.mark.parametrize("policy", POLICIES)
def test_decode_step_makes_no_host_sync_beyond_transformers(policy, lengths):
    model = tiny_model("llama")
    base = [s.count for s, _ in decode_step_syncs(model, lengths, STEPS)]
    kvkit.patch(model, policy, **policy_test_options(policy))
    try:
        rows = decode_step_syncs(model, lengths, STEPS)
    finally:
        kvkit.unpatch(model)
    plain = [(i, s) for i, (s, event) in enumerate(rows) if not event]
    assert len(plain) >= STEPS // 2, f"{policy}: too few steps between compression events to check"
    for i, s in plain:
        assert s.count <= base[i], (
            f"{policy}: decode step {i} made {s.count} host syncs (unpatched transformers: {base[i]}): {dict(s.where())}")


def test_counter_sees_every_kind_of_sync():
    t = torch.arange(6)
    with HostSyncCounter() as s:
        t.sum().item()
        bool(t[0])
        int(t[1])
        t.tolist()
        _ = t[t > 2]
        t.nonzero()
        torch.equal(t, t)
        torch.repeat_interleave(t, t)
    assert s.count == 8, s.calls
    assert all(w.startswith("tests/core/test_decode_syncs.py:") for w in s.where()), s.where()  # the caller's line
    with HostSyncCounter() as s:  # fixed-shape device work reads nothing on the host
        m = t > 2
        torch.where(m, t, -1).cumsum(0).topk(2)
        t.masked_fill(m, 0)
        torch.repeat_interleave(t, t, output_size=15)
    assert s.count == 0, s.calls
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the wrapper is removed on exit
