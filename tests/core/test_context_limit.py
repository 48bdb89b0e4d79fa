"""Prompts longer than the model's trained context (config.max_position_embeddings): refused with an error that
says what to do, or run with a warning after ``kvkit.patch(..., allow_beyond_context=True)``."""

import warnings

import pytest
import torch

import kvkit
from kvkit.doctor import small_options
from kvkit.testing import random_ids, tiny_model

LIMIT = 32


def _model(arch="llama"):
    return tiny_model(arch, max_position_embeddings=LIMIT)


@pytest.mark.parametrize("policy", kvkit.available_policies())
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_generate_refuses_prompt_beyond_context(arch, policy):
    model = _model(arch)
    kvkit.patch(model, policy, **small_options(policy))
    with pytest.raises(ValueError, match=r"42 tokens exceed the trained context of 32 .*prompt 40 \+ max_new_tokens 2\).*allow_beyond_context=True"):
        model.generate(random_ids(40), max_new_tokens=2, do_sample=False)
    kvkit.unpatch(model)


def test_refused_when_generation_crosses_the_limit():
    model = _model()
    kvkit.patch(model, "streaming", budget=16, sink=2, tail=4)
    # refused before anything runs (no tokens generated and then lost)
    with pytest.raises(ValueError, match=r"the request \(prompt 28 \+ max_new_tokens 8\) has 36 tokens.*<= 32"):
        model.generate(random_ids(28), max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match=r"prompt 28 \+ max_new_tokens 8"):
        model.generate(random_ids(28), max_length=36, do_sample=False)
    out = model.generate(random_ids(24), max_new_tokens=8, do_sample=False)  # exactly at the limit: fine
    assert out.shape[1] == 32


def test_prefill_refuses_before_running_any_chunk():
    model = _model()
    kvkit.patch(model, "streaming", budget=16, sink=2, tail=4)
    cache = kvkit.KVCache(model)
    with pytest.raises(ValueError, match=r"kvkit.prefill has 40 tokens.*allow_beyond_context"):
        kvkit.prefill(model, random_ids(40), chunk_size=8, cache=cache)
    assert cache.get_seq_length() == 0  # nothing ran
    kvkit.prefill(model, random_ids(20), chunk_size=8, cache=cache)
    with pytest.raises(ValueError, match=r"the cache holds 20 tokens and the prompt given to kvkit.prefill adds 16"):
        kvkit.prefill(model, random_ids(16), chunk_size=8, cache=cache)
    assert cache.get_seq_length() == 20


def test_plain_forward_refused_too():
    model = _model()
    kvkit.patch(model, "full")
    with pytest.raises(ValueError, match="trained context of 32"):
        model(random_ids(33), use_cache=False)


def test_allow_beyond_context_runs_with_one_warning():
    model = _model()
    ids = random_ids(40)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)  # transformers itself does not check
    kvkit.patch(model, "full", allow_beyond_context=True)
    with pytest.warns(UserWarning, match=r"exceed the trained context of 32.*allow_beyond_context=True") as rec:
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert sum("trained context" in str(w.message) for w in rec) == 1  # once per patch, not per token
    assert torch.equal(out, ref)
    kvkit.patch(model, "streaming", budget=16, sink=2, tail=4, allow_beyond_context=True)
    with pytest.warns(UserWarning, match="trained context"):
        cache, logits = kvkit.prefill(model, ids, chunk_size=8)
    assert cache.get_seq_length() == 40 and torch.isfinite(logits).all()


def test_no_warning_within_context():
    model = _model()
    kvkit.patch(model, "full", allow_beyond_context=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(random_ids(20), max_new_tokens=4, do_sample=False)


def test_allow_beyond_context_must_be_bool():
    with pytest.raises(ValueError, match="allow_beyond_context must be True or False"):
        kvkit.patch(_model(), "full", allow_beyond_context="yes")
