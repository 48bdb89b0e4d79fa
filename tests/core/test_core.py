"""Foundation: patch/unpatch, KVCache, the `full` and `streaming` policies on tiny random models."""

import pytest
import torch
from transformers import DynamicCache

import kvkit
from kvkit.testing import TINY_ARCHS, greedy, greedy_stacked, left_padded_batch, tiny_model


@pytest.fixture(params=TINY_ARCHS)
def arch(request):
    return request.param


def _logits_and_tokens(model, ids, mask=None, steps=32):
    return greedy_stacked(model, ids, steps, mask)


@pytest.mark.parametrize("batch", [1, 3])
def test_full_matches_unpatched(arch, batch):
    model = tiny_model(arch)
    if batch == 1:
        ids, mask = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1)), None
    else:
        ids, mask, _ = left_padded_batch([40, 31, 17])
    ref_toks, ref_logits, ref_cache = _logits_and_tokens(model, ids, mask)
    assert isinstance(ref_cache, DynamicCache)
    kvkit.patch(model, "full")
    toks, logits, cache = _logits_and_tokens(model, ids, mask)
    assert isinstance(cache, kvkit.KVCache)
    assert cache.get_seq_length() == ids.shape[1] + 32
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(toks, ref_toks)
    # generate() also picks up the KVCache without any argument
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, kvkit.KVCache)
    assert torch.equal(out.sequences[:, ids.shape[1] :], ref_toks[:, :8])
    kvkit.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    toks2, logits2, cache2 = _logits_and_tokens(model, ids, mask)
    assert isinstance(cache2, DynamicCache)
    assert torch.equal(logits2, ref_logits) and torch.equal(toks2, ref_toks)


def test_explicit_kvcache_and_nbytes():
    model = tiny_model("llama")
    kvkit.patch(model, "full")
    ids = torch.randint(1, 128, (2, 20))
    cache = kvkit.KVCache(model)
    out = model(ids, past_key_values=cache, use_cache=True)
    assert out.past_key_values is cache
    cfg = model.config
    per_layer = 2 * 2 * cfg.num_key_value_heads * 20 * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert cache.nbytes(per_layer=True) == [per_layer] * cfg.num_hidden_layers
    assert cache.nbytes() == per_layer * cfg.num_hidden_layers
    # an explicit cache for another policy than the patched one
    c2 = kvkit.KVCache(model, "streaming", budget=8, sink=2, tail=4)
    model(ids, past_key_values=c2, use_cache=True)
    assert c2.num_slots() == [8] * cfg.num_hidden_layers
    assert c2.get_seq_length() == 20


def test_use_cache_false_and_plain_forward_match():
    model = tiny_model("qwen2")
    ids = torch.randint(1, 128, (1, 25))
    ref = model(ids, use_cache=False).logits
    kvkit.patch(model, "streaming", budget=8, sink=2)
    out = model(ids, use_cache=False)
    assert out.past_key_values is None
    torch.testing.assert_close(out.logits, ref)
    # prefill attention is exact for every policy: same logits over the prompt
    out = model(ids, use_cache=True)
    torch.testing.assert_close(out.logits, ref, rtol=1e-5, atol=1e-5)


def _streaming_formula(model, n_slots, batch=1):
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    return batch * n_slots * (2 * cfg.num_key_value_heads * d * 4 + 4)  # fp32 K+V, int32 position


@pytest.mark.parametrize("arch_", ["llama", "qwen2"])
def test_streaming_memory_bounded(arch_):
    model = tiny_model(arch_)
    budget, sink, tail = 16, 4, 8
    kvkit.patch(model, "streaming", budget=budget, sink=sink, tail=tail)
    ids = torch.randint(1, 128, (2, 50))
    toks, _, cache = greedy(model, ids, 40)
    L = model.config.num_hidden_layers
    for n in cache.num_slots():
        assert n <= budget + tail
    assert cache.nbytes(per_layer=True) == [_streaming_formula(model, n, 2) for n in cache.num_slots()]
    full = kvkit.KVCache(model, "full")
    model(torch.cat([ids, toks], 1), past_key_values=full, use_cache=True)
    assert cache.nbytes() * 3 < full.nbytes()
    assert cache.get_seq_length() == 90 and len(cache.nbytes(per_layer=True)) == L


def test_streaming_reads_exactly_sinks_and_window():
    """Decode under streaming == an explicit sink+window mask over the full KV."""
    model = tiny_model("llama")
    budget, sink = 12, 3
    ids = torch.randint(1, 128, (1, 30))
    kvkit.patch(model, "streaming", budget=budget, sink=sink, tail=5)
    toks, logits, cache = greedy(model, ids, 12)
    kvkit.unpatch(model)
    # reference: full model, decode step t at position p sees positions < sink or > p - window
    seq = torch.cat([ids, toks], 1)
    window = budget - sink
    dc = DynamicCache()
    out = model(ids, past_key_values=dc, use_cache=True)
    ref_logits = [out.logits[:, -1]]
    for t in range(12):
        p = 30 + t  # position of the decoded token
        keep = torch.arange(p + 1)
        m = ((keep < sink) | (keep > p - window)).view(1, 1, 1, p + 1)
        out = model(seq[:, p : p + 1], past_key_values=dc, attention_mask=m.float().log(), use_cache=True)
        ref_logits.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(logits, 1), torch.stack(ref_logits, 1), rtol=1e-4, atol=1e-4)


def test_streaming_crop_beyond_tail_raises():
    model = tiny_model("llama")
    kvkit.patch(model, "streaming", budget=8, sink=2, tail=2)
    toks, _, cache = greedy(model, torch.randint(1, 128, (1, 20)), 6)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-6)


def test_generate_beam_search_reorders():
    model = tiny_model("llama")
    kvkit.patch(model, "streaming", budget=12, sink=2, tail=4)
    ids = torch.randint(1, 128, (1, 30))
    out = model.generate(ids, max_new_tokens=10, num_beams=3, do_sample=False)
    assert out.shape == (1, 40)
    kvkit.patch(model, "full")
    kvkit.unpatch(model)
    ref = model.generate(ids, max_new_tokens=10, num_beams=3, do_sample=False)
    kvkit.patch(model, "full")
    assert torch.equal(model.generate(ids, max_new_tokens=10, num_beams=3, do_sample=False), ref)


def test_registry_and_bad_input():
    assert kvkit.available_policies()[:2] == ["full", "streaming"]
    with pytest.raises(ValueError, match="known policies: full, streaming"):
        kvkit.get_policy("nope")
    with pytest.raises(ValueError, match="valid options: compression_ratio=None, preset=.kvkit., budget=1024, sink=4, tail=32"):
        kvkit.get_policy("streaming", window=3)
    for bad in (dict(budget=0), dict(budget=-5), dict(budget=8, sink=8), dict(budget=8, sink=9), dict(sink=-1)):
        with pytest.raises(ValueError, match="streaming"):
            kvkit.get_policy("streaming", **bad)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown kvkit policy"):
        kvkit.patch(model, "duoo")
    assert model.config._attn_implementation == "sdpa"  # a failed patch leaves the model alone


def test_patch_twice_repatches_cleanly():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 30))
    ref = model(ids).logits
    kvkit.patch(model, "streaming", budget=8, sink=2)
    kvkit.patch(model, "streaming", budget=16, sink=4)
    kvkit.patch(model, "full")
    assert str(kvkit.patched_policy(model)) == "full"
    n_hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    assert n_hooks == 1 + model.config.num_hidden_layers
    torch.testing.assert_close(model(ids).logits, ref)
    kvkit.unpatch(model)
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    assert not any(hasattr(m, "_kvkit_store") for m in model.modules())
    assert torch.equal(model(ids).logits, ref)


def test_patch_state_accessors():
    from kvkit.patch import PatchState, is_patched, patch_state

    model = tiny_model("llama")
    assert patch_state(model) is None and not is_patched(model)
    assert patch_state(object()) is None and not is_patched(None)  # anything that is not a patched model
    kvkit.patch(model, "streaming", budget=8, sink=2, allow_beyond_context=True)
    state = patch_state(model)
    assert isinstance(state, PatchState) and is_patched(model)
    assert state.policy is kvkit.patched_policy(model) and state.allow_beyond_context and not state.static
    kvkit.unpatch(model)
    assert patch_state(model) is None and not is_patched(model)


def test_unsupported_models_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(ValueError, match="rotary position embeddings.*GPT2LMHeadModel|GPT2LMHeadModel.*rotary"):
        kvkit.patch(gpt2, "streaming")
    t5 = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64, d_kv=16))
    with pytest.raises(ValueError, match="encoder-decoder"):
        kvkit.patch(t5, "full")
    with pytest.raises(ValueError, match="PreTrainedModel"):
        kvkit.patch(torch.nn.Linear(2, 2), "full")


@pytest.mark.parametrize("T,n,D,per_head", [(2, 37, 64, False), (5, 1000, 64, False), (64, 300, 128, False),
                                             (9, 4096, 64, False), (5, 200, 64, True)])
def test_cpu_masked_gqa_matches_transformers_bitwise(T, n, D, per_head):
    # hf_sdpa's CPU shortcut (native masked GQA instead of transformers' repeat_kv copy) gives the same bits
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvkit.stores import hf_sdpa

    g = torch.Generator().manual_seed(T * n)
    B, H, G = 2, 3, 3
    q = torch.randn(B, H * G, T, D, generator=g)
    k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    mask = torch.ones(T, n, dtype=torch.bool).tril(n - T)[None, None].expand(B, 1, T, n).clone()
    mask[1, :, :, : n // 3] = False  # left padding in the second row
    if per_head:  # a mask per query head takes torch's own masked GQA
        mask = mask.expand(B, H * G, T, n).clone()
        mask[0, 4, :, 5] = False
    module = SimpleNamespace(num_key_value_groups=G, is_causal=True, training=False)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=D**-0.5)
    out = hf_sdpa(module, q, k, v, mask, D**-0.5)
    assert out.shape == ref.shape == (B, T, H * G, D)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("T,n,G", [(2, 40, 3), (5, 700, 3), (9, 300, 1), (4, 5, 2)])
def test_causal_suffix_attention_matches_masked_sdpa(T, n, G):
    # prefix (flash, no mask) + causal suffix merged by log-sum-exp == masked attention, up to rounding
    import torch.nn.functional as F

    from kvkit.stores import causal_suffix_attention

    g = torch.Generator().manual_seed(T + n)
    B, H, D = 2, 2, 32
    q = torch.randn(B, H * G, T, D, generator=g)
    k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    causal = torch.ones(T, n, dtype=torch.bool).tril(n - T)[None, None].expand(B, 1, T, n)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=0.2, enable_gqa=True).transpose(1, 2)
    for mask in (causal, None, torch.zeros(B, 1, T, n).masked_fill(~causal, float("-inf"))):
        out = causal_suffix_attention(q, k, v, mask, 0.2)
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    padded = causal.clone()
    padded[1, :, :, :2] = False  # left padding: not the plain causal mask -> the caller's masked kernel
    assert causal_suffix_attention(q, k, v, padded, 0.2) is None
    assert causal_suffix_attention(q[:, :, :1], k, v, None, 0.2) is None  # one query: nothing to split


def test_full_store_appends_in_place_and_crops_exactly():
    # decode steps write into the preallocated buffer (no copy of the whole layer); a crop + update overwrites
    # the cropped slots; a deepcopy is independent; the values always equal DynamicLayer's concatenation
    import copy

    from transformers.cache_utils import DynamicLayer

    from kvkit.stores import FullStore, LayerInfo

    g = torch.Generator().manual_seed(0)
    store, ref = FullStore(LayerInfo(0, 1, 4, 2, 8)), DynamicLayer()
    chunks = [torch.randn(1, 2, t, 8, generator=g) for t in (10, 1, 1, 3, 1)]
    ptrs = []
    for c in chunks:
        k, v = store.update(c, c + 1)
        rk, rv = ref.update(c, c + 1)
        assert torch.equal(k, rk) and torch.equal(v, rv)
        ptrs.append(k.data_ptr())
    assert len(set(ptrs)) == 1  # 16 tokens fit in the first buffer (10 + headroom)
    assert store.nbytes() == 2 * 16 * 2 * 8 * 4 and store.allocated_nbytes() == 2 * (10 + store.headroom) * 2 * 8 * 4
    snap = copy.deepcopy(store)
    store.crop(-4)
    ref.crop(-4)
    new = torch.randn(1, 2, 2, 8, generator=g)
    k, _ = store.update(new, new)
    rk, _ = ref.update(new, new)
    assert torch.equal(k, rk) and k.data_ptr() == ptrs[0] and store.get_seq_length() == 14
    assert snap.get_seq_length() == 16 and torch.equal(snap.keys[:, :, 12:], torch.cat(chunks, 2)[:, :, 12:])
    big = torch.randn(1, 2, store.headroom + 1, 8, generator=g)  # past the buffer: re-allocated, values kept
    k, _ = store.update(big, big)
    rk, _ = ref.update(big, big)
    assert torch.equal(k, rk) and k.data_ptr() != ptrs[0]
    store.keys = store.keys.index_select(0, torch.tensor([0]))  # replaced from outside (beam reorder)
    store.values = store.values.index_select(0, torch.tensor([0]))
    k, _ = store.update(new, new)
    rk, _ = ref.update(new, new)
    assert torch.equal(k, rk)
    store.reset()
    assert store.get_seq_length() == 0 and not store._bufs


def test_cache_argument_of_the_installed_transformers(recwarn):
    """transformers 5.24 renamed the cache argument (past_key_values -> cache): kvkit's hooks accept either name,
    its own forwards pass the installed release's (no deprecation warning from kvkit code), and a patched model
    swaps in a KVCache under the name the caller used."""
    import warnings

    import transformers
    from packaging.version import Version

    from kvkit.compat import CACHE_ARG, cache_kw, get_cache, output_cache, set_cache
    from kvkit.evals.shared_prefill import record_prefill, replay_prefill

    new = Version(transformers.__version__).release >= (5, 24)
    assert CACHE_ARG == ("cache" if new else "past_key_values")
    kw = {"past_key_values": 1}
    set_cache(kw, 2)
    assert kw == {"past_key_values": 2} and get_cache(kw) == 2
    kw = {}
    set_cache(kw, 3)
    assert kw == {CACHE_ARG: 3} and get_cache({"cache": None, "past_key_values": 4}) == 4
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    kvkit.patch(model, "streaming", budget=12, sink=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # transformers' deprecation of the old name
            cache = kvkit.KVCache(model)
            out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
            assert output_cache(out) is cache and cache.get_seq_length() == 24
            out = model(input_ids=ids, use_cache=True)  # no cache given: the hook swaps one in
            assert isinstance(output_cache(out), kvkit.KVCache)
            g = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
            assert isinstance(output_cache(g), kvkit.KVCache)
            rec = record_prefill(model, ids)
            assert len(rec.calls) == model.config.num_hidden_layers
            assert replay_prefill(model, rec).get_seq_length() == 24
        # the old name still works on a release that renamed it (with transformers' own warning)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = kvkit.KVCache(model)
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 24
    finally:
        kvkit.unpatch(model)
