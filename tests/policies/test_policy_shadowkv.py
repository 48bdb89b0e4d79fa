"""shadowkv: low-rank pre-RoPE keys, landmarks, outliers, offloaded values (tiny random models)."""

import pytest
import torch

import kvkit
from kvkit.model_info import apply_rope, inverse_rope
from kvkit.policies.shadowkv import ShadowKVStore
from kvkit.testing import calibration_file, greedy, left_padded_batch, tiny_model

SMALL = dict(min_prompt=32, chunk_size=8)  # tiny prompts get compressed
WIDTH = 2 * 16  # tiny models: 2 KV heads x head_dim 16


def _ids(n, seed=1, batch=1):
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _run(model, ids, steps=12, mask=None):
    toks, logits, cache = greedy(model, ids, steps, attention_mask=mask)
    return toks, torch.stack(logits, 1), cache


def _stores(cache):
    return [layer for layer in cache.layers if isinstance(layer, ShadowKVStore)]


def test_inverse_rope_is_exact():
    model = tiny_model("llama")
    cache = kvkit.KVCache(model, "shadowkv")
    rope = cache.infos[0].rope
    cos, sin = rope(torch.arange(300)[None])
    x = torch.randn(1, 300, 16, dtype=torch.float64)
    for scale in (1.0, 1.3):  # attention scaling of YaRN/longrope multiplies cos and sin
        c, s = cos.double() * scale, sin.double() * scale
        torch.testing.assert_close(inverse_rope(apply_rope(x, c, s), c, s), x)
    # matches transformers' own rotation
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = torch.randn(1, 2, 300, 16)
    _, k = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(inverse_rope(k, cos[:, None], sin[:, None]), q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_short_prompt_is_full(arch):
    model = tiny_model(arch)
    ids = _ids(40)
    ref_toks, ref_logits, _ = _run(model, ids)
    kvkit.patch(model, "shadowkv")  # min_prompt 4096: a 40-token prompt is not compressed
    toks, logits, cache = _run(model, ids)
    assert not any(s.compressed for s in _stores(cache))
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert cache.offloaded_nbytes() == 0
    kvkit.unpatch(model)


@pytest.mark.parametrize("landmark", ["mean", "minmax"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])  # gemma3: RoPE per layer type
def test_degenerate_equals_full(arch, landmark):
    """Full rank and a budget covering every chunk: exactly full attention (up to fp32 SVD error)."""
    model = tiny_model(arch)
    ids = _ids(83)  # 10 chunks + 3: 6 compressed chunks, local window 32 + 3
    ref_toks, ref_logits, _ = _run(model, ids, steps=16)
    kvkit.patch(model, "shadowkv", rank=WIDTH, budget=256, outliers=2, landmark=landmark, **SMALL)
    toks, logits, cache = _run(model, ids, steps=16)
    stores = _stores(cache)  # gemma3: only its global layer is a ShadowKV layer
    assert stores and all(s.compressed for s in stores)
    assert stores[0].lm_ids.shape[-1] == 4 and stores[0].out_k.shape[-2] == 16
    assert stores[0].landmarks.shape[-1] == (16 if landmark == "mean" else 32)  # head_dim 16; min-max: 2 x 16
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(toks, ref_toks)
    kvkit.unpatch(model)


def test_lossy_setting_differs_but_stays_close():
    model = tiny_model("llama")
    ids = _ids(83)
    _, ref_logits, _ = _run(model, ids, steps=4)
    kvkit.patch(model, "shadowkv", rank=4, budget=8, outliers=1, **SMALL)
    _, logits, _ = _run(model, ids, steps=4)
    assert not torch.allclose(logits, ref_logits, atol=1e-4)  # really compressed
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("landmark", ["mean", "minmax"])
def test_nbytes_formula(landmark):
    model = tiny_model("llama")
    B, S, H, D, r, c = 2, 83, 2, 16, 5, 8
    W = D if landmark == "mean" else 2 * D  # a min-max landmark holds the max and the min of its chunk's keys
    kvkit.patch(model, "shadowkv", budget=16, outliers=1, landmark=landmark, **SMALL)  # rank None -> 5
    cache = kvkit.KVCache(model)
    with torch.no_grad():
        model(_ids(S, batch=B), past_key_values=cache, use_cache=True)
    C = S // c - 4  # 6 chunks, 1 outlier per head, 5 landmarks per head
    n_out, Cl, N, Tt = 1, C - 1, C * c, S - C * c
    f = 4  # fp32 tiny model; int32 metadata
    per_layer = (
        B * N * r * f  # U
        + B * H * r * D * f  # S*V^T
        + B * H * Cl * W * f  # landmarks
        + B * H * Cl * 4  # landmark chunk ids
        + B * 4  # chunks per row
        + 2 * B * H * n_out * c * D * f  # outlier K and V
        + B * H * n_out * c * 4  # outlier positions
        + B * 4  # RoPE offset per row
        + 2 * B * H * Tt * D * f  # local window K and V
        + B * Tt * 4  # local positions
        + B * 4  # first_pos
    )
    layers = model.config.num_hidden_layers
    assert cache.nbytes(per_layer=True) == [per_layer] * layers
    assert cache.offloaded_nbytes() == layers * B * H * N * D * f
    store = cache.layers[0]
    assert store.U.shape == (B, N, r) and store.SV.shape == (B, H, r, D)
    # generated tokens stay exact: each adds K + V + its position
    with torch.no_grad():
        model(_ids(3, seed=5, batch=B), past_key_values=cache, use_cache=True)
        model(_ids(1, seed=6, batch=B), past_key_values=cache, use_cache=True)
    assert cache.nbytes() == layers * (per_layer + 4 * (2 * B * H * D * f + B * 4))


@pytest.mark.parametrize("landmark", ["mean", "minmax"])
def test_read_nbytes_formula(landmark):
    # a decode step reads: landmarks, the selected chunks' U rows (per KV head) + their offloaded values,
    # S*V^T, outliers and the exact local/generated slots - not the whole low-rank store
    model = tiny_model("llama")
    B, S, H, D, r, c, budget = 2, 83, 2, 16, 5, 8, 16
    W = D if landmark == "mean" else 2 * D
    kvkit.patch(model, "shadowkv", budget=budget, outliers=1, landmark=landmark, **SMALL)
    cache = kvkit.KVCache(model)
    with torch.no_grad():
        model(_ids(S, batch=B), past_key_values=cache, use_cache=True)
        model(_ids(1, seed=6, batch=B), past_key_values=cache, use_cache=True)  # compresses, then decodes
    kvkit.unpatch(model)
    C = S // c - 4
    n_out, Cl, Tt = 1, C - 1, S - C * c + 1  # local window + the decoded token
    f = 4
    per_layer = (
        B * H * budget * (r * f + D * f)  # gathered U rows and offloaded values of budget // c chunks
        + B * H * r * D * f  # S*V^T
        + B * H * Cl * W * f + B * H * Cl * 4  # landmarks and their chunk ids
        + 2 * B * H * n_out * c * D * f + B * H * n_out * c * 4  # outliers
        + 2 * B * H * Tt * D * f + B * Tt * 4  # local + generated K, V, positions
    )
    layers = model.config.num_hidden_layers
    assert cache.read_nbytes(per_layer=True) == [per_layer] * layers
    assert cache.read_nbytes() < cache.nbytes() + cache.offloaded_nbytes()


@pytest.mark.parametrize("landmark", ["mean", "minmax"])
def test_crop_and_multitoken_exact(landmark):
    model = tiny_model("qwen2")
    kvkit.patch(model, "shadowkv", budget=16, outliers=1, landmark=landmark, **SMALL)
    ids = _ids(83, batch=2)
    toks, logits, cache = _run(model, ids, steps=6)
    seen = cache.get_seq_length()
    cache.crop(seen - 3)  # drop the last 3 generated tokens
    assert cache.get_seq_length() == seen - 3
    with torch.no_grad():
        # re-feeding toks[3:6] in one forward (speculative verification) gives the logits of the single steps
        out = model(toks[:, 3:6], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(out.logits, logits[:, 4:7], rtol=1e-5, atol=1e-5)
    cache.crop(seen - 3)
    with torch.no_grad():
        for i in range(3, 6):
            out = model(toks[:, i : i + 1], past_key_values=cache, use_cache=True)
            torch.testing.assert_close(out.logits[:, -1], logits[:, i + 1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(50)  # below the compressed prompt


@pytest.mark.parametrize("landmark", ["mean", "minmax"])
def test_batch_left_padding_matches_single(landmark):
    model = tiny_model("llama")
    kvkit.patch(model, "shadowkv", budget=16, outliers=1, landmark=landmark, **SMALL)
    lengths = [83, 70, 61]  # 6, 4 and 3 chunks: rows with invalid chunks
    ids, mask, prompts = left_padded_batch(lengths)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    assert all(s.compressed for s in _stores(out.past_key_values))
    logits = torch.stack(out.logits, 1)
    for i, p in enumerate(prompts):
        one = model.generate(p[None], max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        torch.testing.assert_close(logits[i], torch.stack(one.logits, 1)[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(out.sequences[i, ids.shape[1]:], one.sequences[0, len(p):])


def test_chunked_prefill_compresses_at_first_decode_step():
    model = tiny_model("llama")
    kvkit.patch(model, "shadowkv", rank=WIDTH, budget=256, outliers=2, **SMALL)
    ids = _ids(83)
    _, ref_logits, _ = _run(model, ids, steps=4)
    cache, last = kvkit.prefill(model, ids, chunk_size=24)
    assert not any(s.compressed for s in _stores(cache))
    torch.testing.assert_close(last, ref_logits[:, 0], rtol=1e-4, atol=1e-4)
    nxt = last.argmax(-1, keepdim=True)
    with torch.no_grad():
        out = model(nxt, past_key_values=cache, use_cache=True)
    assert all(s.compressed for s in _stores(cache))
    torch.testing.assert_close(out.logits[:, -1], ref_logits[:, 1], rtol=1e-4, atol=1e-4)


def test_bad_options():
    model = tiny_model("llama")
    for opts, msg in [
        (dict(rank=0), "rank"),
        (dict(rank=-3), "rank"),
        (dict(budget=0), "budget"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(budget=4, chunk_size=8), "budget"),
        (dict(outliers=-1), "outliers"),
        (dict(min_prompt=1.5), "min_prompt"),
        (dict(landmark="max"), "landmark must be one of"),
    ]:
        with pytest.raises(ValueError, match=msg):
            kvkit.patch(model, "shadowkv", **opts)
    with pytest.raises(ValueError, match="larger than the key width"):
        kvkit.patch(model, "shadowkv", rank=WIDTH + 1)
    with pytest.raises(ValueError, match="larger than the key width"):
        kvkit.KVCache(model, "shadowkv", rank=WIDTH + 1)
    kvkit.patch(model, "shadowkv", rank=WIDTH)  # full rank is fine
    kvkit.unpatch(model)


@pytest.mark.slow
def test_default_model_full_rank_matches_full(default_model):
    """Real weights (SmolLM2-135M, fp32): full rank + a budget over all chunks decode as full."""
    from kvkit.demo import needle_prompt

    model, tokenizer = default_model
    ids, _ = needle_prompt(tokenizer, context_tokens=250)
    kvkit.unpatch(model)
    ref_toks, ref_logits, _ = _run(model, ids, steps=4)
    try:
        kvkit.patch(model, "shadowkv", rank=192, budget=1024, min_prompt=128)
        toks, logits, cache = _run(model, ids, steps=4)
        assert all(s.compressed for s in _stores(cache)) and cache.offloaded_nbytes() > 0
        assert torch.equal(toks, ref_toks)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-3, atol=2e-3)
        # the paper's rank scaled to this model: round(160 / 1024 * 3 * 64) = 30 (the default takes the
        # model's calibrated rank, kvkit/data/calibration)
        assert kvkit.KVCache(model, "shadowkv", calibrated=False).layers[0].rank == 30
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("landmark", ["mean", "minmax"])
@pytest.mark.parametrize("c_kernel", ["1", "0"])  # the selected chunks through kvkit/kernels/lowrank_cpu, or torch
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_cpu_step_matches_general_path(arch, c_kernel, landmark, monkeypatch):
    """The single-token CPU step gives the general path's logits (lowrank_decode's reference + two exact
    attentions merged by LSE) at a lossy setting, on a left-padded batch whose rows have different numbers of
    chunks (selections padded with -1)."""
    from kvkit.policies.shadowkv import ShadowKVStore

    monkeypatch.setenv("KVKIT_DECODE_CPU", c_kernel)
    model = tiny_model(arch)
    kvkit.patch(model, "shadowkv", rank=6, budget=16, outliers=1, landmark=landmark, **SMALL)
    ids, mask, _ = left_padded_batch([83, 70, 61])

    def run():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)

    fused = run()
    monkeypatch.setattr(ShadowKVStore, "fused_cpu_step", False)
    general = run()
    kvkit.unpatch(model)
    assert all(s.compressed for s in _stores(fused.past_key_values))
    torch.testing.assert_close(torch.stack(fused.logits, 1), torch.stack(general.logits, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.sequences, general.sequences)


@pytest.mark.parametrize("c_kernel", ["1", "0"])
def test_fused_cpu_step_merge_matches_concat(c_kernel, monkeypatch):
    """The fused step's two ways of combining its parts (one attention over their concatenation, or one per
    part merged by log-sum-exp, taken when the parts are large) give the same logits."""
    from kvkit.policies.shadowkv import ShadowKVStore

    monkeypatch.setenv("KVKIT_DECODE_CPU", c_kernel)
    model = tiny_model("llama")
    kvkit.patch(model, "shadowkv", rank=6, budget=16, outliers=1, **SMALL)
    ids, mask, _ = left_padded_batch([83, 70, 61])
    outs = []
    for below in (1 << 30, 0):
        monkeypatch.setattr(ShadowKVStore, "concat_below", below)
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=0))
    kvkit.unpatch(model)
    torch.testing.assert_close(torch.stack(outs[0].logits, 1), torch.stack(outs[1].logits, 1), rtol=1e-5, atol=1e-5)


def test_under_a_compression_ratio_the_default_rank_costs_a_selected_token_no_more_than_its_exact_key(caldir):
    """A calibrated rank wider than ``head_dim`` makes each selected token's ``U`` row cost more than the key it
    rebuilds; at a fixed ratio the default rank is then ``head_dim`` and the saved bytes select more tokens. A
    given rank, the paper's preset and a token budget keep their rank."""
    from kvkit.compat import cache_kw

    model = tiny_model("llama")  # 2 KV heads x head_dim 16: keys 32 wide
    calibration_file(caldir / "tiny.json", model.config,
                     {"shadowkv": {"options": {"rank": 24}, "command": "test", "date": "2026-12-06"}})

    def rank(**kw):
        return kvkit.KVCache(model, "shadowkv", **kw).layers[0].rank

    assert rank() == 24  # token budget: the calibrated rank
    assert rank(compression_ratio=0.5) == 16  # capped at head_dim
    assert rank(compression_ratio=0.5, rank=24) == 24  # the user's rank is kept
    assert rank(compression_ratio=0.5, calibrated=False) == 5  # the paper's round(160 / 1024 * 32)

    # the same ratio over the same prompt: the capped rank selects more tokens and still reads 1 - r of full's bytes
    ids = _ids(400)
    budgets = {}
    for kw in (dict(), dict(rank=24)):
        kvkit.patch(model, "shadowkv", compression_ratio=0.5, **kw)
        _, _, cache = _run(model, ids, steps=2)
        full = kvkit.KVCache(model, "full")
        with torch.no_grad():
            model(ids, **cache_kw(full))
        store = _stores(cache)[0]
        budgets[kw.get("rank", store.rank)] = store.budget
        assert abs(cache.read_nbytes() / full.read_nbytes() - 0.5) < 0.05
        kvkit.unpatch(model)
    assert budgets[16] > budgets[24]


def test_under_a_compression_ratio_a_chunk_is_the_smallest_whose_landmarks_take_half_the_reads():
    """With ``chunk_size`` unset a chunk is the paper's 8 tokens, and under ``compression_ratio`` r the smallest power
    of two (at least 2) whose landmarks take at most half of the ``1 - r`` a step may read (a smaller chunk's mean
    key dilutes a needle's key less); min-max landmarks are twice as wide. A given chunk size and the paper's preset
    keep theirs. With the chunk unset every ratio is reachable; a given chunk whose landmarks alone pass ``1 - r`` is
    refused with the range it reaches. The ratio holds on a prompt with the resolved chunk."""
    from kvkit.compat import cache_kw

    get = kvkit.get_policy
    assert get("shadowkv").chunk() == 8
    chunks = {r: get("shadowkv", compression_ratio=r).chunk() for r in (0.25, 0.5, 0.6, 0.75, 0.875, 0.9)}
    assert chunks == {0.25: 2, 0.5: 2, 0.6: 4, 0.75: 4, 0.875: 8, 0.9: 16}
    assert [get("shadowkv", compression_ratio=r, landmark="minmax").chunk() for r in (0.5, 0.75)] == [4, 8]
    assert get("shadowkv", compression_ratio=0.5, chunk_size=16).chunk() == 16
    assert get("shadowkv", compression_ratio=0.5, preset="paper").chunk() == 8
    assert get("shadowkv", preset="paper").options()["chunk_size"] == 8

    model = tiny_model("llama")
    for r in (0.75, 0.9):
        get("shadowkv", compression_ratio=r).validate(model.config)
        get("shadowkv", compression_ratio=r, landmark="minmax").validate(model.config)
    with pytest.raises(ValueError, match=r"shadowkv.*reaches compression ratios in \[0\.000, 0\.875\]"):
        get("shadowkv", compression_ratio=0.9, chunk_size=4).validate(model.config)
    with pytest.raises(ValueError, match=r"shadowkv.*reaches compression ratios in \[0\.000, 0\.750\]"):
        get("shadowkv", compression_ratio=0.75, chunk_size=4, landmark="minmax").validate(model.config)
    with pytest.raises(ValueError, match=r"budget \(2\) must be at least chunk_size \(4\)"):
        get("shadowkv", budget=2, chunk_size=4)

    ids = _ids(400)
    kvkit.patch(model, "shadowkv", compression_ratio=0.5)
    try:
        _, _, cache = _run(model, ids, steps=2)
    finally:
        kvkit.unpatch(model)
    full = kvkit.KVCache(model, "full")
    with torch.no_grad():
        model(ids, **cache_kw(full))
    store = _stores(cache)[0]
    assert store.chunk == 2
    assert store.landmarks.shape[-2] + store.out_k.shape[-2] // 2 == 400 // 2 - store.local_chunks
    assert abs(cache.read_nbytes() / full.read_nbytes() - 0.5) < 0.05
