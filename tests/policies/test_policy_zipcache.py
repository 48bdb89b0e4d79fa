"""zipcache: saliency-driven mixed-precision packed KV (tiny random models)."""

import math

import pytest
import torch

import kvkit
from kvkit.policies.zipcache import ZipCache, ZipCacheStore, probe_positions
from kvkit.stores import LayerInfo
from kvkit.testing import greedy_stacked as _run
from kvkit.testing import left_padded_batch, tiny_model
from kvkit.testing import random_ids as _ids

H, D = 2, 16  # tiny models: 2 KV heads x head_dim 16, fp32


def _stores(cache):
    return [layer for layer in cache.layers if isinstance(layer, ZipCacheStore)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_8bit_everywhere_is_close_to_full(arch):
    """8-bit keys (per channel) and values (per token): logits within 5e-3, same greedy tokens."""
    model = tiny_model(arch)
    ids = _ids(60)
    ref_toks, ref_logits, _ = _run(model, ids, steps=12)
    kvkit.patch(model, "zipcache", high_bits=8, low_bits=8, requant_interval=5)
    toks, logits, cache = _run(model, ids, steps=12)
    assert all(len(s.segments) == 3 for s in _stores(cache))  # prompt + two re-quantised blocks of 5
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=5e-3)
    assert torch.equal(toks, ref_toks)
    kvkit.unpatch(model)


def test_default_bits_are_lossy_but_close():
    model = tiny_model("llama")
    ids = _ids(60)
    _, ref_logits, _ = _run(model, ids, steps=4)
    kvkit.patch(model, "zipcache")
    _, logits, _ = _run(model, ids, steps=4)
    err = (logits - ref_logits).abs().max()
    assert 1e-4 < err < 0.2
    kvkit.unpatch(model)


@pytest.mark.parametrize("n", [50, 61])
@pytest.mark.parametrize("layout", ["paper", "default"])
def test_nbytes_formula(n, layout):
    """Paper layout (key_group=None, stats="auto" on an fp32 model): one fp32 key statistic per channel per part.
    kvkit's default: key statistics per 32 tokens of a part, every scale / zero point in fp16."""
    model = tiny_model("llama")
    opts = dict(key_group=None, stats="auto") if layout == "paper" else {}
    kvkit.patch(model, "zipcache", **opts)  # 60% at 4 bits, 40% at 2 bits
    cache = kvkit.KVCache(model)
    with torch.no_grad():
        model(input_ids=_ids(n), past_key_values=cache, use_cache=True)
    hi = math.ceil(0.6 * n)
    s_bytes, kg = (4, None) if layout == "paper" else (2, 32)
    expect = 4  # first_pos int32 [1]
    for m, bits in ((hi, 4), (n - hi, 2)):
        codes = 2 * H * m * D * bits // 8  # keys + values, packed
        groups = 1 if kg is None else math.ceil(m / kg)
        key_stats = 2 * H * groups * D * s_bytes  # scale + zero per channel per key group
        value_stats = 2 * H * m * s_bytes + H * D * 4  # scale + zero per token, fp32 prescale per channel
        expect += codes + key_stats + value_stats + 8  # + the group's valid length (int64 [1])
    for s in _stores(cache):
        assert s.quantized_tokens() == n and s.keys.shape[-2] == 0
        assert s.nbytes() == expect
    full = 2 * H * n * D * 4
    assert full / expect > 4  # fp32 baseline; head_dim 16 makes per-token value stats weigh a lot
    kvkit.unpatch(model)


def test_requant_interval_and_crop_is_exact():
    model = tiny_model("llama")
    kvkit.patch(model, "zipcache", requant_interval=4)
    toks, _, cache = _run(model, _ids(30), steps=9)  # 9 decode tokens: requant at 4 and 8 -> tail 1
    stores = _stores(cache)
    assert all(len(s.segments) == 3 and s.keys.shape[-2] == 1 for s in stores)
    extra = torch.randint(1, 128, (1, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = [(s.keys.clone(), s.values.clone(), s.pos.clone(), s.nbytes()) for s in stores]
        a = model(input_ids=extra, past_key_values=cache, use_cache=True).logits
        assert all(s.keys.shape[-2] == 4 for s in stores)  # 3 new tokens join the fp tail
        cache.crop(cache.get_seq_length() - 3)
        for s, (k, v, p, nb) in zip(stores, before):
            assert torch.equal(s.keys, k) and torch.equal(s.values, v) and torch.equal(s.pos, p)
            assert s.nbytes() == nb
        b = model(input_ids=extra, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(a, b)
    kvkit.unpatch(model)


@pytest.mark.parametrize("opts", [dict(requant_interval=3), dict(high_bits=8, low_bits=4, high_ratio=0.3)])
def test_batch_left_padding_equals_single(opts):
    model = tiny_model("llama")
    kvkit.patch(model, "zipcache", **opts)
    ids, mask, prompts = left_padded_batch([41, 26, 33])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    logits = torch.stack(out.logits, 1)
    for i, p in enumerate(prompts):
        one = model.generate(p[None], max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        torch.testing.assert_close(logits[i], torch.stack(one.logits, 1)[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(out.sequences[i, ids.shape[1]:], one.sequences[0, len(p):])
    kvkit.unpatch(model)


def test_saliency_matches_naive_loop():
    """Probe attention summed over the group's query heads and probes, divided by the probes that see a token."""
    torch.manual_seed(0)
    n, Hq = 40, 4
    info = LayerInfo(0, 1, Hq, H, D)
    store = ZipCacheStore(info, ZipCache(probe_ratio=0.1))
    store.keys = torch.randn(1, H, n, D)
    store.values = torch.randn(1, H, n, D)
    store.pos = torch.arange(n, dtype=torch.int32).view(1, 1, n)
    q = torch.randn(1, Hq, n, D)
    got = store._saliency_prefill(q, 0.25)
    probes = probe_positions(n, 0.1, 0)
    assert len(probes) == 8 and probes[-4:].tolist() == [36, 37, 38, 39]
    want = torch.zeros(1, H, n)
    seen = torch.zeros(n)
    for t in probes.tolist():
        seen[: t + 1] += 1
        for h in range(Hq):
            a = torch.softmax(q[0, h, t] @ store.keys[0, h // 2, : t + 1].T * 0.25, -1)
            want[0, h // 2, : t + 1] += a
    torch.testing.assert_close(got, want / seen.clamp(min=1), rtol=1e-5, atol=1e-6)


def test_salient_tokens_get_high_precision():
    """A token the probes attend to strongly is stored at 8 bits, the rest at 2 bits."""
    torch.manual_seed(0)
    n = 32
    store = ZipCacheStore(LayerInfo(0, 1, 2, 2, D), ZipCache(high_bits=8, low_bits=2, high_ratio=0.1))
    k = torch.randn(1, 2, n, D)
    v = torch.randn(1, 2, n, D)
    sal = torch.rand(1, 2, n)
    sal[..., 7] = 10.0
    seg = store.quantize_block(k, v, torch.ones(1, n, dtype=torch.bool), sal)
    (k8, v8, n8), (k2, v2, n2) = seg.parts
    assert (k8.bits, k2.bits, int(n8), int(n2)) == (8, 2, 4, 28)
    from kvkit.kernels import dequantize

    vals = dequantize(v8)
    assert bool((vals - v[:, :, 7:8]).abs().amax(-1).amin(-1).lt(0.05).all())  # token 7 is in the 8-bit group


def test_key_bits_keeps_every_key_at_one_width():
    """key_bits=4: keys of both saliency groups at 4 bits, values keep the 4/2 split; bytes follow."""
    model = tiny_model("llama")
    n = 50
    kvkit.patch(model, "zipcache", key_bits=4, key_group=None, stats="auto")  # the paper's layout of statistics
    cache = kvkit.KVCache(model)
    with torch.no_grad():
        model(input_ids=_ids(n), past_key_values=cache, use_cache=True)
    hi = math.ceil(0.6 * n)
    expect = 4  # first_pos int32 [1]
    for m, vbits in ((hi, 4), (n - hi, 2)):
        codes = H * m * D * (4 + vbits) // 8
        expect += codes + 2 * H * D * 4 + 2 * H * m * 4 + H * D * 4 + 8
    for s in _stores(cache):
        assert [(k.bits, v.bits) for k, v, _ in s.parts()] == [(4, 4), (4, 2)]
        assert s.nbytes() == expect
    kvkit.unpatch(model)


@pytest.mark.parametrize("bad", [dict(high_bits=3), dict(key_bits=3), dict(key_bits=True), dict(low_bits=1), dict(high_bits=16), dict(high_bits=2, low_bits=4),
                                 dict(high_ratio=1.5), dict(high_ratio=-0.1), dict(requant_interval=0),
                                 dict(probe_ratio=0), dict(high_bits=True), dict(key_group=0), dict(key_group=1.5),
                                 dict(stats="bf16")])
def test_bad_options(bad):
    with pytest.raises(ValueError, match="zipcache"):
        kvkit.get_policy("zipcache", **bad)


@torch.no_grad()
def _after_verification(model, ids, round_ids, keep: int, steps: int = 8):
    """Prefill, 2 decode steps, a verification forward of ``round_ids`` whose first ``keep`` tokens are kept (the
    rest cropped), then ``steps`` greedy steps: the saliency sums right after the crop and the logits after."""
    cache = kvkit.KVCache(model)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    for _ in range(2):
        out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    cache.reserve(round_ids.shape[1])
    with cache.verification():
        out = model(input_ids=round_ids, past_key_values=cache, use_cache=True)
    cache.crop(-(round_ids.shape[1] - keep))
    sums = [(s.sal_sum.clone(), s.sal_cnt.clone()) for s in _stores(cache)]
    nxt, logits = out.logits[:, keep - 1 : keep].argmax(-1), []
    for _ in range(steps):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1:].argmax(-1)
    return sums, torch.stack(logits, 1)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_partly_rejected_verification_keeps_only_the_accepted_queries_saliency(static):
    """A verification of 5 tokens of which 2 are kept: the tail's saliency sums are those a verification of the 2
    alone leaves (the rejected queries' attention removed), and so is the decoding after (its re-quantisations)."""
    model = tiny_model("llama")
    ids, round_ids = _ids(40, seed=3), _ids(5, seed=9)
    kvkit.patch(model, "zipcache", static=static, requant_interval=8)
    try:
        sums, logits = _after_verification(model, ids, round_ids, keep=2)
        ref_sums, ref_logits = _after_verification(model, ids, round_ids[:, :2], keep=2)
    finally:
        kvkit.unpatch(model)
    for (s, c), (rs, rc) in zip(sums, ref_sums):
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=1e-7)
        assert torch.equal(c, rc)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
