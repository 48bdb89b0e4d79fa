"""Behaviour on the bundled real model (SmolLM2-135M-Instruct): needs real weights."""

import pytest
import torch

import kvkit
from kvkit.demo import needle_prompt, run_policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def needle_2k(default_model):
    model, tok = default_model
    ids, expected = needle_prompt(tok, context_tokens=1900, depth=0.4, seed=3)
    assert 1900 < ids.shape[1] < 2200
    return ids, expected


def test_full_answers_needle_like_unpatched(default_model, needle_2k):
    model, tok = default_model
    ids, expected = needle_2k
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    kvkit.patch(model, "full")
    try:
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    finally:
        kvkit.unpatch(model)
    assert torch.equal(out, ref)
    assert expected in tok.decode(out[0, ids.shape[1] :])


def test_streaming_256_saves_5x(default_model, needle_2k):
    model, tok = default_model
    ids, _ = needle_2k
    full = run_policy(model, tok, ids, "full", max_new_tokens=2)
    stream = run_policy(model, tok, ids, "streaming", max_new_tokens=2, budget=256)
    assert full.kv_bytes >= 5 * stream.kv_bytes
    # 30 layers x 3 KV heads x 64 dims x fp32 K+V, plus an int32 position per slot
    n_full = ids.shape[1] + 1  # prompt + the first generated token fed back
    assert full.kv_bytes == 30 * n_full * 2 * 3 * 64 * 4
    assert stream.kv_bytes <= 30 * (256 + 32) * (2 * 3 * 64 * 4 + 4)


def test_a_freshly_converted_model_names_the_folder_its_tokenizer_loads_from(tmp_path, monkeypatch):
    """The first load converts the GGUF into the cache; the config then names that folder (as every later load
    does), so what loads the tokenizer from the config's path (kvzip's instruct=True) works in that process too."""
    from transformers import AutoTokenizer

    from kvkit.models import load

    monkeypatch.setenv("KVKIT_CACHE", str(tmp_path))
    model, tok = load("default")
    path = model.config._name_or_path
    assert str(tmp_path) in path
    again = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert again.encode("Repeat the previous context.") == tok.encode("Repeat the previous context.")
