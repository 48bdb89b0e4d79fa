"""Chunked prefill: exact for `full`, memory bounded for compressing policies, continues into generate()."""

import torch

import kvkit
from kvkit.testing import greedy, left_padded_batch, tiny_model


def test_chunked_prefill_full_matches_one_shot():
    model = tiny_model("llama")
    kvkit.patch(model, "full")
    ids, mask, _ = left_padded_batch([50, 37])
    one = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    cache, logits = kvkit.prefill(model, ids, attention_mask=mask, chunk_size=16)
    torch.testing.assert_close(logits, one, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 50


def test_chunked_prefill_then_generate_matches_plain_generate():
    model = tiny_model("qwen2")
    kvkit.patch(model, "full")
    ids = torch.randint(1, 128, (1, 45))
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    cache, _ = kvkit.prefill(model, ids[:, :-1], chunk_size=10)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)


def test_chunked_prefill_streaming_bounded():
    model = tiny_model("llama")
    budget, tail, chunk = 16, 4, 8
    kvkit.patch(model, "streaming", budget=budget, sink=2, tail=tail)
    cache = kvkit.KVCache(model)
    ids = torch.randint(1, 128, (1, 120))
    peak = 0
    for s in range(0, 120, chunk):
        kvkit.prefill(model, ids[:, s : s + chunk], cache=cache, chunk_size=chunk)
        peak = max(peak, max(cache.num_slots()))
    assert peak <= budget + tail + chunk
    assert cache.get_seq_length() == 120
    toks, _, _ = greedy(model, torch.randint(1, 128, (1, 1)), 3, cache=cache)
    assert toks.shape == (1, 3)


def test_chunk_size_validation():
    model = tiny_model("llama")
    kvkit.patch(model, "full")
    for bad in (0, -3, 2.5):
        try:
            kvkit.prefill(model, torch.ones(1, 4, dtype=torch.long), chunk_size=bad)
        except ValueError as e:
            assert "chunk_size" in str(e)
        else:
            raise AssertionError("no error")
