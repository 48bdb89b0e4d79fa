"""A static cache takes ``compression_ratio`` once it knows its prompt's length (``KVCache(..., static=True,
prompt_length=n)``): its stores resolve the ratio's knob for ``n`` tokens when built, as the growing cache does at a
prefill of ``n`` tokens, so both decode the same greedy tokens and a decode step reads the same K/V bytes
(``read_nbytes``: equal, the static layout's free slots are not counted there); a compiled step works with it; a
first forward of another length and a missing ``prompt_length`` are refused; the CUDA default keeps the static path
under a ratio.
"""

import warnings

import pytest
import torch
from transformers import CompileConfig

import kvkit
from kvkit.compat import cache_kw, output_cache
from kvkit.patch import defaults
from kvkit.registry import get_policy
from kvkit.testing import left_padded_batch, random_ids, tiny_model

LAYERS = 6  # tidal: 3 layers read every token, the other 3 a selection (ratios up to 0.5 reachable)
PROMPT, STEPS = 48, 10
PATTERN = [[0.9, 0.1], [0.2, 0.8], [0.7, 0.3], [0.4, 0.6], [0.15, 0.85], [0.5, 0.45]]
#: each policy's ratio and the options of a tiny model (its native ratio knobs left at their defaults)
RATIO = {
    "streaming": (0.5, dict(sink=2, tail=4)),
    "snapkv": (0.5, dict(window=4, kernel=3, tail=4, protect_heads=0.0)),
    "cake": (0.5, dict(window=4, protect_heads=0.0)),
    "kvzip": (0.5, dict(window=4, sink=2, chunk=8, overlap=2, tail=4, protect_heads=0.0)),
    "chelsea": (0.4, dict(chunk_size=8, window=4, sink=2, merge_interval=8, protect_heads=0.0)),
    "shadowkv": (0.3, dict(offload=False)),
    "tidal": (0.3, dict()),
    "duo": (0.4, dict(pattern=PATTERN, sink=2, recent=8, tail=4)),
    "zipcache": (0.8, dict(requant_interval=4)),
}
POLICIES = sorted(RATIO)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=LAYERS)


def _cache(model, policy, static, n, **extra):
    r, opts = RATIO[policy]
    kw = dict(static=True, max_length=n + STEPS, prompt_length=n) if static else {}
    return kvkit.KVCache(model, policy, compression_ratio=r, **opts, **kw, **extra)


@torch.no_grad()
def _greedy(model, ids, cache, step=None, mask=None):
    """Prefill, then ``STEPS`` greedy single-token steps (``step``: the forward, default the model); returns
    (tokens ``[B, STEPS]``, ``read_nbytes`` after the first decode step, the cache)."""
    step = step or model
    kw = {}
    if mask is not None:
        kw["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, **cache_kw(cache), use_cache=True, **kw)
    toks, reads = [], None
    for i in range(STEPS):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            kw["position_ids"] = kw["position_ids"][:, -1:] + 1
        out = step(input_ids=nxt, attention_mask=mask, **cache_kw(cache), use_cache=True, **kw)
        if i == 0:
            reads = int(cache.read_nbytes())
    return torch.cat(toks, 1), reads, cache


@pytest.mark.parametrize("policy", POLICIES)
def test_static_cache_with_a_ratio_decodes_and_reads_as_the_growing_cache(policy, model):
    ids = random_ids(PROMPT, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no head pattern ships for a random model
        kvkit.patch(model, policy, compression_ratio=RATIO[policy][0], **RATIO[policy][1])
        try:
            grow_toks, grow_reads, grow = _greedy(model, ids, _cache(model, policy, False, PROMPT))
            stat_toks, stat_reads, stat = _greedy(model, ids, _cache(model, policy, True, PROMPT))
        finally:
            kvkit.unpatch(model)
    full = 2 * LAYERS * 2 * 16 * (PROMPT + 1) * 4  # K and V, 2 KV heads, head_dim 16, fp32
    assert grow_reads < full  # the ratio compresses at all
    assert stat.is_compileable and not grow.is_compileable
    assert torch.equal(stat_toks, grow_toks)
    assert stat_reads == grow_reads, f"{policy}: static reads {stat_reads}, growing {grow_reads}"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["snapkv", "streaming", "duo"])
def test_left_padded_batch_declares_its_padded_length(policy, model):
    ids, mask, _ = left_padded_batch([PROMPT, PROMPT - 9], seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvkit.patch(model, policy, compression_ratio=RATIO[policy][0], **RATIO[policy][1])
        try:
            grow_toks, grow_reads, _ = _greedy(model, ids, _cache(model, policy, False, PROMPT), mask=mask)
            stat_toks, stat_reads, _ = _greedy(model, ids, _cache(model, policy, True, PROMPT), mask=mask)
        finally:
            kvkit.unpatch(model)
    assert torch.equal(stat_toks, grow_toks) and stat_reads == grow_reads


def test_static_store_knobs_are_resolved_when_built(model):
    """Before any forward the static stores hold the knob for the declared prompt (buffers sized for it)."""
    r, opts = RATIO["streaming"]
    cache = _cache(model, "streaming", True, PROMPT)
    budget = cache.layers[0].budget
    with kvkit.patched(model, "streaming", compression_ratio=r, **opts):
        with torch.no_grad():
            model(input_ids=random_ids(PROMPT, seed=3), **cache_kw(cache), use_cache=True)
    assert budget == cache.layers[0].budget == pytest.approx((1 - r) * PROMPT, abs=2)
    duo = _cache(model, "duo", True, PROMPT)
    assert all(layer.parts for layer in duo.layers)  # heads split before the first forward


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["snapkv", "duo"])
def test_compiled_static_step_with_a_ratio_equals_eager(policy, model, fresh_dynamo):
    ids = random_ids(PROMPT, seed=5)
    cc = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None)
    cc._compile_all_devices = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvkit.patch(model, policy, compression_ratio=RATIO[policy][0], **RATIO[policy][1])
        try:
            ref_toks, ref_reads, _ = _greedy(model, ids, _cache(model, policy, True, PROMPT))
            with torch._dynamo.config.patch(error_on_recompile=True):
                toks, reads, cache = _greedy(model, ids, _cache(model, policy, True, PROMPT),
                                             step=model.get_compiled_call(cc))
        finally:
            kvkit.unpatch(model)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(toks, ref_toks) and reads == ref_reads
    assert cache.get_seq_length() == PROMPT + STEPS


@pytest.mark.parametrize("policy", ["snapkv", "duo", "tidal", "chelsea", "shadowkv", "cake", "kvzip", "streaming"])
def test_static_ratio_without_prompt_length_is_refused_naming_it(policy, model):
    r, opts = RATIO[policy]
    with pytest.raises(ValueError, match="pass prompt_length=.*or give"):
        kvkit.KVCache(model, policy, compression_ratio=r, static=True, max_length=64, **opts)


def test_zipcache_static_ratio_needs_no_prompt_length(model):
    r, opts = RATIO["zipcache"]
    cache = kvkit.KVCache(model, "zipcache", compression_ratio=r, static=True, max_length=64, **opts)
    assert cache.is_compileable and cache.prompt_length is None


@pytest.mark.parametrize("n", [PROMPT - 8, PROMPT + 1])
def test_a_first_forward_of_another_length_is_refused(n, model):
    cache = _cache(model, "snapkv", True, PROMPT)
    with kvkit.patched(model, "snapkv", compression_ratio=0.5, **RATIO["snapkv"][1]):
        with pytest.raises(ValueError, match=f"prompt_length={PROMPT}.*first forward has {n}"):
            with torch.no_grad():
                model(input_ids=random_ids(n), **cache_kw(cache), use_cache=True)
    assert cache.get_seq_length() == 0  # refused before anything was written


def test_prompt_length_is_checked_and_inert_without_a_static_ratio(model):
    with pytest.raises(ValueError, match="prompt_length must be a positive integer"):
        kvkit.KVCache(model, "full", prompt_length=0)
    grow = kvkit.KVCache(model, "snapkv", compression_ratio=0.5, prompt_length=PROMPT)
    fixed = kvkit.KVCache(model, "snapkv", budget=16, window=4, static=True, prompt_length=PROMPT)
    assert grow.prompt_length is None and fixed.prompt_length is None  # no first-forward check there


def test_cuda_default_keeps_the_static_path_with_a_ratio(monkeypatch, model):
    monkeypatch.setattr(defaults, "_said", set())
    for policy in POLICIES:
        r, opts = RATIO[policy]
        pol = get_policy(policy, compression_ratio=r, **opts)
        assert defaults.static_fits(model, pol) is None, policy
    pol = get_policy("snapkv", compression_ratio=0.5, **RATIO["snapkv"][1])
    with pytest.warns(defaults.StaticDefaultWarning):
        assert defaults.choose_static(model, pol, None, device="cuda") is True


def test_generate_on_a_faked_cuda_model_with_a_ratio_decodes_over_a_static_cache(monkeypatch, model):
    """``kvkit.patch(model, "snapkv", compression_ratio=...)`` + ``generate`` on CUDA: the static path, sized and
    resolved for the request's prompt, with the growing cache's tokens."""
    ids = random_ids(PROMPT, seed=9)
    r, opts = RATIO["snapkv"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvkit.patch(model, "snapkv", compression_ratio=r, **opts)
        try:
            ref = model.generate(ids, max_new_tokens=6, do_sample=False)
            monkeypatch.setattr(defaults, "model_device", lambda m: torch.device("cuda", 0))
            kvkit.patch(model, "snapkv", compression_ratio=r, **opts)
            out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        finally:
            kvkit.unpatch(model)
    cache = output_cache(out)
    assert cache.is_compileable and cache.prompt_length == PROMPT
    assert torch.equal(out.sequences, ref)


def test_patch_static_with_a_ratio_is_accepted_and_each_cache_asks_for_its_prompt(model):
    r, opts = RATIO["snapkv"]
    with kvkit.patched(model, "snapkv", compression_ratio=r, static=True, **opts):
        with pytest.raises(ValueError, match="pass prompt_length="):
            kvkit.KVCache(model)  # the caller chose static: no silent growing cache
        assert kvkit.KVCache(model, prompt_length=PROMPT).is_compileable
        with torch.no_grad():  # a forward without a cache: the hook builds one for this forward's length
            out = model(input_ids=random_ids(PROMPT), use_cache=True)
        assert output_cache(out).is_compileable


def test_cache_of_your_own_on_the_cuda_default_without_a_prompt_length_is_the_growing_one(monkeypatch, model):
    monkeypatch.setattr(defaults, "model_device", lambda m: torch.device("cuda", 0))
    monkeypatch.setattr(defaults, "_said", {"static"})
    r, opts = RATIO["snapkv"]
    with kvkit.patched(model, "snapkv", compression_ratio=r, **opts):
        assert not kvkit.KVCache(model).is_compileable  # the static default was kvkit's choice, not the caller's
        assert kvkit.KVCache(model, prompt_length=PROMPT).is_compileable


@pytest.mark.parametrize("policy", ["snapkv", "tidal"])
def test_chunked_prefill_into_a_static_cache_resolves_the_ratio_for_its_first_chunk(policy, model):
    ids = random_ids(PROMPT, seed=11)
    r, opts = RATIO[policy]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = {}
        for static in (False, True):
            with kvkit.patched(model, policy, compression_ratio=r, static=static, **opts):
                cache, last = kvkit.prefill(model, ids, chunk_size=32)
                got[static] = (last, cache.num_slots(), cache.is_compileable)
    assert got[True][2] and not got[False][2]
    torch.testing.assert_close(got[True][0], got[False][0])
    assert got[True][1] == got[False][1]


def test_shared_prefill_replays_into_a_static_cache_with_a_ratio(model):
    from kvkit.workloads.shared_prefill import record_prefill, replay_prefill

    ids = random_ids(PROMPT, seed=13)
    r, opts = RATIO["streaming"]
    with kvkit.patched(model, "full"):
        rec = record_prefill(model, ids)
    slots = {}
    for static in (False, True):
        with kvkit.patched(model, "streaming", compression_ratio=r, static=static, **opts):
            cache = replay_prefill(model, rec)
            slots[static] = (cache.num_slots(), cache.is_compileable)
    assert slots[True][1] and slots[True][0] == slots[False][0]
