"""A replayed prefill (kvkit.evals.shared_prefill) leaves exactly the cache the policy's own prefill leaves."""

import pytest
import torch

import kvkit
from kvkit.doctor import small_options
from kvkit.evals.shared_prefill import NOT_REPLAYABLE, record_prefill, replay_prefill, replayable_policies
from kvkit.testing import greedy, random_ids, tiny_model


def _stores_equal(a, b):
    assert a.get_seq_length() == b.get_seq_length()
    assert a.nbytes() == b.nbytes()
    for la, lb in zip(a.layers, b.layers):
        for name in ("keys", "values", "pos"):
            ta, tb = getattr(la, name, None), getattr(lb, name, None)
            if isinstance(ta, torch.Tensor):
                assert torch.equal(ta, tb), name


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("policy", replayable_policies())
def test_replay_equals_own_prefill(arch, policy):
    model = tiny_model(arch)
    ids = random_ids(60, seed=3)
    ctx, question = ids[:, :48], ids[:, 48:]
    kvkit.patch(model, policy, **small_options(policy))
    try:
        own, _ = kvkit.prefill(model, ctx, chunk_size=48)
        rec = record_prefill(model, ctx)
        replayed = replay_prefill(model, rec)
        _stores_equal(own, replayed)
        # the recording is reusable: a second replay gives the same cache again, also without computing the
        # prompt's attention output, which no store keeps (what the evals' replays do)
        _stores_equal(own, replay_prefill(model, rec))
        skipped = replay_prefill(model, rec, skip_prompt_attention=True)
        _stores_equal(own, skipped)
        assert torch.equal(greedy(model, question, 6, cache=skipped)[0], greedy(model, question, 6,
                                                                                 cache=replay_prefill(model, rec))[0])
        t_own, l_own, _ = greedy(model, question, 6, cache=own)
        t_rep, l_rep, _ = greedy(model, question, 6, cache=replayed)
        assert torch.equal(t_own, t_rep)
        for a, b in zip(l_own, l_rep):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        kvkit.unpatch(model)


def test_replay_refuses_non_exact_prefill_and_unpatched(monkeypatch):
    model = tiny_model("llama")
    ids = random_ids(30, seed=1)
    with pytest.raises(ValueError, match="kvkit.patch"):
        record_prefill(model, ids)
    kvkit.patch(model, "full")
    rec = record_prefill(model, ids)
    kvkit.patch(model, "streaming", **small_options("streaming"))
    # a policy whose prefill is not exact is refused
    monkeypatch.setitem(NOT_REPLAYABLE, "streaming", lambda policy: "a pass after the prefill")
    try:
        with pytest.raises(ValueError, match="cannot be replayed"):
            replay_prefill(model, rec)
    finally:
        kvkit.unpatch(model)
