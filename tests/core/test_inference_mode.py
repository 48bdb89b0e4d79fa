"""A cache filled under ``torch.inference_mode()`` (a forward or ``kvkit.prefill``) decodes afterwards outside it
(``generate`` runs under ``no_grad``): every policy, growing and static, decodes the tokens of a cache filled under
``no_grad``, as transformers' ``DynamicCache`` allows."""

import pytest
import torch

import kvkit
from kvkit.registry import policy_class
from kvkit.testing import policy_test_options, random_ids, tiny_model

POLICIES = kvkit.available_policies()


def _fill(model, ids, how: str):
    if how == "prefill":
        return kvkit.prefill(model, ids, chunk_size=16)[0]
    cache = kvkit.KVCache(model)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("how", ["forward", "prefill"])
@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("policy", POLICIES)
def test_cache_filled_under_inference_mode_decodes_outside_it(policy, static, how):
    if static and not policy_class(policy).static_capable:
        pytest.skip(f"{policy} has no static stores")
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    kvkit.patch(model, policy, static=static, **policy_test_options(policy))
    try:
        with torch.inference_mode():
            cache = _fill(model, ids[:, :-1], how)
        assert cache.inference_tensors
        out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert not cache.inference_tensors
        with torch.no_grad():
            ref_cache = _fill(model, ids[:, :-1], how)
        ref = model.generate(ids, past_key_values=ref_cache, max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert torch.equal(out, ref)
    finally:
        kvkit.unpatch(model)


def test_views_of_one_buffer_share_one_normal_copy():
    """The copy keeps aliasing: a held prefix and the buffer it is a view of stay one storage, so an append written
    into the buffer is what the prefix view reads."""
    from kvkit.stores.normal import to_normal_tensors

    class Holder:
        pass

    Holder.__module__ = "kvkit.tests_holder"
    h = Holder()
    with torch.inference_mode():
        h.buf = torch.arange(12.0).view(2, 6)
        h.prefix = h.buf[:, :4]
        h.parts = [(h.buf[0], {"n": torch.ones(2)})]
    assert to_normal_tensors(h)
    assert not h.buf.is_inference() and not h.prefix.is_inference() and not h.parts[0][1]["n"].is_inference()
    h.buf[:, 1].fill_(-1.0)
    assert torch.equal(h.prefix[:, 1], torch.tensor([-1.0, -1.0])) and h.parts[0][0][1] == -1.0
    assert not to_normal_tensors(h)  # nothing left to copy
