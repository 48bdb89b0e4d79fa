"""``protect_heads`` (kvkit.policies.protect_heads): the KV heads a DuoAttention pattern ranks highest keep every token, the
policy evicts in the others only -- for real, in a head-split layer (kvkit.stores.split.HeadSplitStore)."""

import pytest
import torch
from transformers import CompileConfig

import kvkit
from kvkit.compat import cache_kw
from kvkit.evals.settings import file_hashes
from kvkit.policies.protect_heads import protected_heads
from kvkit.policies.snapkv import SnapKVStore
from kvkit.stores.split import HeadSplitStore, WholeHeadsStore
from kvkit.testing import greedy, random_ids, tiny_model

OPTS = dict(budget=16, window=4, kernel=3, tail=4)
CHELSEA = dict(ratio=0.5, chunk_size=8, window=4, sink=2, merge_interval=8, protect_score="reconstruct", recon_chunk=16)


def _pattern(model, top):
    """A pattern ``[L][H]`` whose alpha is 1 on the (layer, KV head) pairs of ``top``, else a small distinct value."""
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    return [[1.0 if (layer, h) in top else 0.01 * (layer * H + h) for h in range(H)] for layer in range(L)]


def test_protected_heads_are_the_patterns_top_fraction():
    model = tiny_model("llama")  # 3 layers x 2 KV heads
    keep = protected_heads("snapkv", model.config, 0.5, _pattern(model, {(0, 1), (2, 0)}))
    # 3 of 6 heads: the two alpha = 1 pairs, then the largest of the rest (layer 2 head 1: 0.05)
    assert keep.tolist() == [[False, True], [False, False], [True, True]]
    assert protected_heads("snapkv", model.config, 0.0) is None


@torch.no_grad()
def test_protected_heads_keep_every_token_and_the_others_are_evicted_by_snapkv():
    model = tiny_model("llama")
    ids = random_ids(60, seed=3)
    kvkit.patch(model, "full")
    try:
        _, _, full = greedy(model, ids, 9)
    finally:
        kvkit.unpatch(model)
    kvkit.patch(model, "snapkv", protect_heads=0.5, protect_pattern=_pattern(model, {(0, 1), (2, 0)}), **OPTS)
    try:
        _, _, cache = greedy(model, ids, 9)
    finally:
        kvkit.unpatch(model)
    n = ids.shape[1] + 9  # 60 prompt tokens + 9 fed back (the last generated token is never fed)
    assert [type(layer) for layer in cache.layers] == [HeadSplitStore, SnapKVStore, HeadSplitStore]
    assert cache.layers[0].head_slots()[1] == n and cache.layers[2].head_slots() == [n, n]
    assert cache.layers[0].head_slots()[0] <= OPTS["budget"] + OPTS["tail"]
    assert cache.layers[1].num_slots() <= OPTS["budget"] + OPTS["tail"]
    # the whole heads hold every prompt token's K/V exactly as the full cache does, in order (the decoded tokens
    # differ once snapkv's eviction changes the output)
    P = ids.shape[1]
    for layer, heads in ((0, [1]), (2, [0, 1])):
        whole = cache.layers[layer].whole
        assert isinstance(whole, WholeHeadsStore)
        assert torch.equal(whole.pos[0, 0, :n], torch.arange(n, dtype=whole.pos.dtype))
        torch.testing.assert_close(whole.keys[:, :, :P], full.layers[layer].keys[:, heads, :P], rtol=0, atol=0)
        torch.testing.assert_close(whole.values[:, :, :P], full.layers[layer].values[:, heads, :P], rtol=0, atol=0)
    # memory: the whole heads' tokens plus the evicted heads' budget, between plain snapkv's and full's
    kvkit.patch(model, "snapkv", **OPTS)
    try:
        _, _, plain = greedy(model, ids, 9)
    finally:
        kvkit.unpatch(model)
    assert plain.nbytes() < cache.nbytes() < full.nbytes() + plain.nbytes()
    assert all(isinstance(layer, SnapKVStore) for layer in plain.layers)  # protect_heads=0: the paper, unchanged


@torch.no_grad()
def test_a_layer_without_protected_heads_is_plain_snapkv():
    model = tiny_model("llama")
    ids = random_ids(50, seed=5)
    kvkit.patch(model, "snapkv", protect_heads=0.1, protect_pattern=_pattern(model, {(1, 0)}), **OPTS)  # 1 of 6 heads
    try:
        _, _, cache = greedy(model, ids, 1)
    finally:
        kvkit.unpatch(model)
    assert [type(layer) for layer in cache.layers] == [SnapKVStore, HeadSplitStore, SnapKVStore]
    kvkit.patch(model, "snapkv", **OPTS)
    try:
        _, _, plain = greedy(model, ids, 1)
    finally:
        kvkit.unpatch(model)
    # layer 0 sees the same inputs (the prompt), so its prefill keeps what plain snapkv keeps
    assert torch.equal(cache.layers[0].pos, plain.layers[0].pos)
    kept = OPTS["budget"]  # the prefill's survivors (the fed-back token after them may differ)
    assert torch.equal(cache.layers[0].keys[:, :, :kept], plain.layers[0].keys[:, :, :kept])
    assert cache.layers[1].head_slots() == [51, plain.layers[1].num_slots()]


def test_protect_without_a_pattern_for_the_model_says_what_to_do():
    model = tiny_model("llama")  # no shipped pattern matches a tiny random config
    with pytest.raises(ValueError, match=r"snapkv: protect_heads=0.2 .*calibrate duo.*protect_heads=0"):
        kvkit.patch(model, "snapkv", protect_heads=0.2, **OPTS)
    kvkit.unpatch(model)


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "half"])
def test_protect_must_be_a_fraction_below_one(bad):
    with pytest.raises(ValueError, match="protect_heads must be a fraction"):
        kvkit.get_policy("snapkv", protect_heads=bad)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("policy,opts", [("snapkv", OPTS), ("cake", dict(budget=16, window=4)),
                                         ("kvzip", dict(budget=16, window=4, sink=2, chunk=8, overlap=2, tail=4)),
                                         ("chelsea", CHELSEA)])
@torch.no_grad()
def test_protected_static_step_compiles_whole_and_equals_eager(policy, opts):
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    opts = dict(opts, protect_heads=0.5, protect_pattern=_pattern(model, {(0, 1), (2, 0)}))
    kvkit.patch(model, policy, **opts)
    ref, _, _ = greedy(model, ids, 12)
    kvkit.patch(model, policy, static=True, **opts)
    try:
        cc = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None)
        cc._compile_all_devices = True
        step = model.get_compiled_call(cc)
        cache = kvkit.KVCache(model)
        assert cache.is_compileable
        out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
        toks = []
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(12):  # tail 4: compressions of the evicted heads between compiled steps
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(nxt)
                out = step(input_ids=nxt, **cache_kw(cache), use_cache=True)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        assert torch.equal(torch.cat(toks, 1), ref)
    finally:
        kvkit.unpatch(model)


KVZIP = dict(budget=16, window=4, sink=2, chunk=8, overlap=2, tail=4, adaptive=False)


@torch.no_grad()
def test_protected_kvzip_scores_only_the_evicted_heads_and_rolls_the_whole_heads_back_exactly():
    model = tiny_model("llama")
    ids = random_ids(60, seed=3)
    pattern = _pattern(model, {(0, 1), (2, 0)})
    kvkit.patch(model, "full")
    try:
        _, _, full = greedy(model, ids, 1)
    finally:
        kvkit.unpatch(model)
    kvkit.patch(model, "kvzip", **KVZIP)
    try:
        _, _, plain = greedy(model, ids, 1)
    finally:
        kvkit.unpatch(model)
    kvkit.patch(model, "kvzip", protect_heads=0.5, protect_pattern=pattern, **KVZIP)
    try:
        _, _, cache = greedy(model, ids, 1)
    finally:
        kvkit.unpatch(model)
    P = ids.shape[1]
    assert [type(layer) for layer in cache.layers] == [HeadSplitStore, type(plain.layers[1]), HeadSplitStore]
    # the reconstruction's repeat forwards were rolled back from the whole heads: they hold the prompt + 1 token
    for layer, heads in ((0, [1]), (2, [0, 1])):
        whole = cache.layers[layer].whole
        assert whole.num_slots() == P + 1
        torch.testing.assert_close(whole.keys[:, :, :P], full.layers[layer].keys[:, heads, :P], rtol=0, atol=0)
    # layer 0's evicted head saw the same prefill and the same repeat as plain kvzip's head 0: it keeps the same slots
    rest = cache.layers[0].rest
    assert rest.keys.shape[1] == 1 and rest.num_slots() <= KVZIP["budget"] + KVZIP["tail"]
    kept = KVZIP["budget"]
    assert torch.equal(rest.pos[:, :, :kept], plain.layers[0].pos[:, :1, :kept])
    torch.testing.assert_close(rest.keys[:, :, :kept], plain.layers[0].keys[:, :1, :kept], rtol=0, atol=0)
    assert (rest.rscore[..., :kept] >= 0).all()  # scored by the reconstruction


def test_kvzip_protect_without_a_pattern_says_what_to_do():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"kvzip: protect_heads=0.3 .*calibrate duo"):
        kvkit.patch(model, "kvzip", protect_heads=0.3, **KVZIP)
    kvkit.unpatch(model)


def test_protect_pattern_is_read_once_checked_and_named_by_its_content(tmp_path):
    from kvkit.policies.duo_patterns import model_identity, save_pattern

    model = tiny_model("llama")
    path = tmp_path / "pattern.json"
    save_pattern(path, torch.tensor(_pattern(model, {(0, 1), (2, 0)})), model_identity(model.config))
    p = kvkit.get_policy("snapkv", protect_heads=0.5, protect_pattern=str(path), **OPTS)
    sha = file_hashes(p)["protect_pattern"]
    path.write_text("not a pattern")  # the policy kept the content it read
    keep = protected_heads("snapkv", model.config, p.protect_heads, p.protect_pattern)
    assert keep.tolist() == [[False, True], [False, False], [True, True]]
    assert len(sha) == 64 and file_hashes(kvkit.get_policy("snapkv", **OPTS)) == {}
    with pytest.raises(ValueError, match="kvzip: protect_pattern: .*not a valid DuoAttention pattern"):
        kvkit.get_policy("kvzip", protect_heads=0.5, protect_pattern=str(path))
    with pytest.raises(ValueError, match="give protect_heads > 0 too"):
        kvkit.get_policy("snapkv", protect_heads=0, protect_pattern=[[1.0, 0.0]])


@pytest.mark.parametrize("policy", ["snapkv", "cake", "kvzip", "chelsea"])
def test_protect_heads_names_the_shipped_pattern_it_ranks_by(policy, tmp_path, monkeypatch):
    """With no ``protect_pattern`` the protected heads come from the pattern shipped for the model: a run's record
    (``kvkit.evals.settings.file_hashes(policy, config)``, what ``kvkit.evals`` keeps as ``option_files``) names that file's content, so a
    recalibrated shipped pattern makes ``--resume`` refuse rows ranked by the old one."""
    import kvkit.policies.duo as duo_mod
    from kvkit.evals.settings import file_sha256
    from kvkit.policies.duo_patterns import model_identity, save_pattern

    model = tiny_model("llama")
    shipped = tmp_path / "shipped.json"
    save_pattern(shipped, torch.tensor(_pattern(model, {(0, 1)})), model_identity(model.config))
    monkeypatch.setattr(duo_mod, "shipped_pattern", lambda config: shipped)
    opts = {"protect_heads": 0.5} if policy != "snapkv" else dict(OPTS, protect_heads=0.5)
    pol = kvkit.get_policy(policy, **opts)
    assert file_hashes(pol) == {}  # nothing read when built
    assert file_hashes(pol, model.config) == {"protect_pattern": file_sha256(shipped)}
    assert file_hashes(kvkit.get_policy(policy, protect_heads=0), model.config) == {}  # ranks nothing
    monkeypatch.setattr(duo_mod, "shipped_pattern", lambda config: None)  # no pattern ships for the model
    assert file_hashes(kvkit.get_policy(policy, **opts), model.config) == {}


@torch.no_grad()
def test_protected_cake_cascades_over_the_layers_with_evicted_heads_only():
    from kvkit.policies.cake import cascade_history

    model = tiny_model("llama")
    ids = random_ids(60, seed=3)
    pattern = _pattern(model, {(0, 1), (2, 0)})  # protect_heads 0.5: layer 0 head 1, layer 2 both heads
    kvkit.patch(model, "cake", budget=16, window=4, protect_heads=0.5, protect_pattern=pattern)
    try:
        _, _, cache = greedy(model, ids, 1)
    finally:
        kvkit.unpatch(model)
    P = ids.shape[1]
    assert cache.layers[0].head_slots()[1] == P + 1 and cache.layers[2].head_slots() == [P + 1, P + 1]
    assert cache.layers[2].rest is None  # nothing evicted there: no CAKE store, no share of the cascade
    final = cascade_history(cache)[-1]
    assert sorted(final) == [0, 1]
    # the budget is per evicted head: the two evicting layers (1 and 2 evicted heads) share (budget - window) x 3
    # evictable head-slots per row (a layer's tokens are its head-slots // its heads: at most 1 lost to rounding)
    held = int(final[0]) * 1 + int(final[1]) * 2
    assert (16 - 4) * 3 - 1 <= held <= (16 - 4) * 3
    live = [cache.layers[0].rest.live(), cache.layers[1].live()]
    assert [int(x.max()) for x in live] == [int(final[0]) + 4 + 1, int(final[1]) + 4 + 1]  # + window + new token


@torch.no_grad()
def test_protected_chelsea_merges_only_the_other_heads_and_counts_every_token_once():
    model = tiny_model("llama")
    ids = random_ids(60, seed=3)
    kvkit.patch(model, "chelsea", protect_heads=0.5, protect_pattern=_pattern(model, {(0, 1), (2, 0)}), **CHELSEA)
    try:
        _, _, cache = greedy(model, ids, 9)
    finally:
        kvkit.unpatch(model)
    n = ids.shape[1] + 9
    assert cache.layers[0].head_slots()[1] == n and cache.layers[2].head_slots() == [n, n]
    assert cache.layers[2].rest is None
    for merged in (cache.layers[0].rest, cache.layers[1]):
        assert merged.num_slots() < n  # merged into centroids
        assert (merged.size.sum(-1) == n).all()  # every token in exactly one cluster, per (row, KV head)
