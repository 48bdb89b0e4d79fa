"""Reliability of the cache / store layer: a cache is never used silently wrong, budgets never overflow, a refused
crop leaves every layer untouched, a generation that crosses the context is refused before it decodes.

The eval / CLI counterparts are in tests/evals/test_reliability_evals.py, speculative ones in tests/speculative/.
"""

import pytest
import torch

import kvkit
from kvkit.testing import greedy, random_ids, tiny_model, tiny_options


def test_cache_continued_after_unpatch_is_refused():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_ids(30, seed=1)
    kvkit.patch(model, "tidal", budget=16)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    kvkit.unpatch(model)
    with pytest.raises(RuntimeError, match=r"kvkit.patch\(model, 'tidal'\)"):
        model.generate(out.sequences, max_new_tokens=4, do_sample=False, past_key_values=out.past_key_values)


def test_cache_of_a_policy_on_a_model_never_patched_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = random_ids(40, seed=2)
    for policy in ("tidal", "cake", "zipcache", "streaming", "duo", "chelsea", "shadowkv", "snapkv"):
        opts = tiny_options(policy)
        if policy == "duo":
            opts["pattern"] = [[0.9, 0.1]] * 4
        with pytest.raises(RuntimeError, match="kvkit.patch"):
            m.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=kvkit.KVCache(m, policy, **opts))


@pytest.mark.parametrize("policy,opts", [
    ("streaming", dict(budget=2**31, sink=4)),
    ("streaming", dict(budget=2**40, sink=4)),
    ("duo", dict(pattern=[[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]], sparsity=0.5, sink=2, recent=2**32)),
    ("snapkv", dict(budget=2**40)),
    ("cake", dict(budget=2**40)),
    ("tidal", dict(budget=2**40)),
])
def test_huge_budget_keeps_everything_no_int32_overflow(policy, opts):
    model = tiny_model("llama")
    ids = random_ids(50, seed=3)
    ref, _, _ = greedy(model, ids, 12)
    kvkit.patch(model, policy, **opts)
    try:
        out, _, _ = greedy(model, ids, 12)
    finally:
        kvkit.unpatch(model)
    assert torch.equal(out, ref)


def test_refused_crop_on_hybrid_model_leaves_every_layer_untouched():
    model = tiny_model("gemma3_text", num_hidden_layers=6, sliding_window=256,
                       layer_types=["sliding_attention"] * 5 + ["full_attention"])
    kvkit.patch(model, "streaming", budget=16, sink=2, tail=4)
    try:
        _, _, cache = greedy(model, random_ids(40, seed=4), 6)
        before = [layer.get_seq_length() for layer in cache.layers]
        with pytest.raises(ValueError, match="cannot crop"):
            cache.crop(-8)
        assert [layer.get_seq_length() for layer in cache.layers] == before
        cache.crop(-1)  # a crop within reach still works, on every layer
        assert [layer.get_seq_length() for layer in cache.layers] == [n - 1 for n in before]
    finally:
        kvkit.unpatch(model)


def test_generation_crossing_the_context_refused_before_decoding():
    model = tiny_model("llama", max_position_embeddings=32)
    kvkit.patch(model, "streaming", budget=16, sink=2, tail=4)
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"prompt 28 \+ max_new_tokens 8"):
            model.generate(random_ids(28), max_new_tokens=8, do_sample=False)
        assert not calls, "the model ran before the request was refused"
        assert model.generate(random_ids(24), max_new_tokens=8, do_sample=False).shape[1] == 32
    finally:
        hook.remove()
        kvkit.unpatch(model)
    assert "generate" not in vars(model)  # unpatch restores the class's generate


@pytest.mark.parametrize("policy", ["full", "streaming", "tidal"])
def test_crop_semantics_are_the_same_for_full_and_compressing_stores(policy):
    model = tiny_model("llama")
    kvkit.patch(model, policy, **tiny_options(policy))
    try:
        _, _, cache = greedy(model, random_ids(30, seed=5), 4)
        seen = cache.get_seq_length()
        cache.crop(seen + 10)  # keep the first m > seen: nothing to remove
        assert cache.get_seq_length() == seen
        cache.crop(0)
        assert cache.get_seq_length() == seen
        cache.crop(seen - 1)  # keep the first seen - 1
        assert cache.get_seq_length() == seen - 1
        with pytest.raises(ValueError, match="has seen only"):
            cache.crop(-(seen + 5))
        assert cache.get_seq_length() == seen - 1
    finally:
        kvkit.unpatch(model)


def test_cache_built_for_another_model_is_refused():
    small = tiny_model("llama", num_hidden_layers=2)
    big = tiny_model("llama", num_hidden_layers=4)
    kvkit.patch(big, "streaming", budget=16, sink=2)
    try:
        with pytest.raises(ValueError, match="built for another model"):
            big(random_ids(10), past_key_values=kvkit.KVCache(small, "streaming", budget=16, sink=2), use_cache=True)
    finally:
        kvkit.unpatch(big)
