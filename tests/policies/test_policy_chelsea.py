"""chelsea: chunked soft-matching clustering with sized centroids (tiny random models)."""

import math

import pytest
import torch

import kvkit
from kvkit.policies.chelsea import ChelseaStore
from kvkit.stores.merge import merge_chunks
from kvkit.testing import greedy_stacked as _run
from kvkit.testing import random_ids as _ids
from kvkit.testing import tiny_model

SMALL = dict(chunk_size=8, window=4, merge_interval=4, sink=2)


def _stores(cache):
    return [layer for layer in cache.layers if isinstance(layer, ChelseaStore)]


def _record_scores(monkeypatch, layers: int = 1) -> list:
    """(score, pos) of the first ``layers`` compressions that carry a protection score, as the store held them."""
    seen = []
    compress = ChelseaStore.compress

    def spy(self):
        if self.score is not None and len(seen) < layers:
            seen.append((self.score.clone(), self.pos.clone()))
        compress(self)

    monkeypatch.setattr(ChelseaStore, "compress", spy)
    return seen


@pytest.mark.parametrize("ratio", [0.5, 0.2])
@pytest.mark.parametrize("protect", [None, 0])
def test_slots_per_chunk_and_nbytes(ratio, protect):
    model = tiny_model("llama")
    n = 70
    kvkit.patch(model, "chelsea", ratio=ratio, protect=protect, **SMALL)
    cache = kvkit.KVCache(model)
    with torch.no_grad():
        model(input_ids=_ids(n), past_key_values=cache, use_cache=True)
    K = math.ceil(ratio * 8)
    chunks = (n - 2 - 4) // 8  # complete chunks between the 2 sinks and the 4-token window
    exact = n - chunks * 8
    for s in _stores(cache):
        assert s.n_merged == chunks * K
        assert s.num_slots() == chunks * K + exact
        assert int(s.merged_upto) == 2 + chunks * 8
        # every token is in exactly one slot
        assert torch.equal(s.size.sum(-1), torch.full((1, 2), n, dtype=torch.int64))
        assert bool((s.size[..., s.n_merged:] == 1).all())
        # centroid position = latest member; all strictly before the exact window
        assert int(s.pos[..., : s.n_merged].max()) < n - 4
        slots = s.num_slots()
        # k, v fp32 [1, 2, slots, 16]; pos, size int32 per head; first_pos int32 [1]; merged_upto int64 [1]; with the
        # default protection (0.8 of the kept slots, at most all but one) an fp32 score per slot and head
        assert s.p.protected_per_chunk == (0 if protect == 0 else min(math.ceil(0.8 * K), K - 1))
        score = 2 * slots * 4 if s.p.protected_per_chunk else 0
        assert s.nbytes() == 2 * 2 * slots * 16 * 4 + 2 * slots * 4 * 2 + 4 + 8 + score
    kvkit.unpatch(model)


def test_merge_chunks_reaches_target_and_preserves_mass():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 5, 64, 16, generator=g), torch.randn(2, 3, 5, 64, 16, generator=g)
    pos = torch.arange(64).expand(2, 3, 5, 64)
    size = torch.ones(2, 3, 5, 64)
    for target in (64, 33, 13, 1):
        mk, mv, mp, ms = merge_chunks(k, v, pos, size, target)
        assert mk.shape == (2, 3, 5, target, 16) and ms.shape == (2, 3, 5, target)
        assert torch.equal(ms.sum(-1), torch.full((2, 3, 5), 64.0))
        # size-weighted means keep the total of keys and values
        torch.testing.assert_close((mk * ms[..., None]).sum(-2), k.sum(-2), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close((mv * ms[..., None]).sum(-2), v.sum(-2), rtol=1e-4, atol=1e-4)
        assert bool((mp[..., 1:] > mp[..., :-1]).all())
    # identical keys merge first
    k2 = k.clone()
    k2[..., 1, :] = k2[..., 0, :]
    mk, _, mp, ms = merge_chunks(k2, v, pos, size, 63)
    assert bool((ms[..., 0] == 2).all()) and bool((mp[..., 0] == 1).all())


def test_decode_merges_periodically_and_crop_is_exact():
    model = tiny_model("llama")
    kvkit.patch(model, "chelsea", ratio=0.25, **SMALL)
    ids = _ids(40)
    toks, _, cache = _run(model, ids, steps=9)
    stores = _stores(cache)
    assert int(stores[0].merged_upto) == 2 + ((49 - 4 - 2) // 8) * 8  # merges went on while decoding
    # crop exactness: feed 3 tokens, crop them, feed again -> same logits as a fresh run
    extra = torch.randint(1, 128, (1, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = [(s.keys.clone(), s.values.clone(), s.pos.clone(), s.size.clone()) for s in stores]
        a = model(input_ids=extra, past_key_values=cache, use_cache=True).logits
        cache.crop(cache.get_seq_length() - 3)
        for s, (k, v, p, z) in zip(stores, before):
            assert torch.equal(s.keys, k) and torch.equal(s.values, v) and torch.equal(s.pos, p)
            assert torch.equal(s.size, z)
        b = model(input_ids=extra, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(a, b)
    kvkit.unpatch(model)


def test_chunked_prefill_matches_mechanics():
    model = tiny_model("qwen2")
    kvkit.patch(model, "chelsea", ratio=0.5, **SMALL)
    ids = _ids(60)
    cache, last = kvkit.prefill(model, ids, chunk_size=16)
    s = _stores(cache)[0]
    assert s.n_merged > 0 and torch.isfinite(last).all()
    assert int(s.size.sum()) == 2 * 60
    kvkit.unpatch(model)


@pytest.mark.parametrize("bad", [dict(ratio=0), dict(ratio=1.5), dict(ratio=-0.1), dict(ratio="half"),
                                 dict(chunk_size=0), dict(window=-1), dict(size_bias="yes"),
                                 dict(protect_kernel=4), dict(protect_kernel=0), dict(protect_pooling="mean"),
                                 dict(protect_window="left")])
def test_bad_options(bad):
    with pytest.raises(ValueError, match="chelsea"):
        kvkit.get_policy("chelsea", **bad)


def test_protect_keeps_the_most_attended_tokens_exact_at_the_same_memory():
    """protect: per chunk, the slots with the highest observation-window attention stay exact (size 1, the very
    key and value); the chunk still keeps ceil(ratio * chunk) slots, so memory matches the paper's matching (plus
    the score), and the protected slots are the top of the score the store computed."""
    model = tiny_model("llama")
    n = 70
    ids = _ids(n)
    caches = {}
    for protect in (0.0, 0.25):
        kvkit.patch(model, "chelsea", ratio=0.5, protect=protect, **SMALL)
        cache = kvkit.KVCache(model)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        caches[protect] = cache
        kvkit.unpatch(model)
    full = kvkit.KVCache(kvkit.patch(model, "full"))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full, use_cache=True)
    kvkit.unpatch(model)
    for i, (a, b) in enumerate(zip(_stores(caches[0.0]), _stores(caches[0.25]))):
        assert a.num_slots() == b.num_slots() and a.n_merged == b.n_merged
        fk, fv = full.layers[i].keys, full.layers[i].values
        H = fk.shape[1]
        for h in range(H):
            m = b.n_merged
            single = (b.size[0, h, :m] == 1).nonzero()[:, 0]
            pos = b.pos[0, h, single].long()
            # every protected (size-1) centroid is the exact token at its position
            torch.testing.assert_close(b.keys[0, h, single], fk[0, h, pos])
            torch.testing.assert_close(b.values[0, h, single], fv[0, h, pos])
            # each merged chunk (8 tokens, 2 protected) has at least its 2 protected tokens exact: those with the
            # highest score among the chunk's tokens
            assert single.numel() >= 2 * (m // 4)
    # the protection changes what is kept
    assert any(not torch.equal(a.keys, b.keys) for a, b in zip(_stores(caches[0.0]), _stores(caches[0.25])))
    nb0 = sum(s.nbytes() for s in _stores(caches[0.0]))
    nb1 = sum(s.nbytes() for s in _stores(caches[0.25]))
    assert nb1 > nb0 and nb1 - nb0 <= sum(s.score.numel() * 4 for s in _stores(caches[0.25]))


def test_protect_selects_by_attention(monkeypatch):
    """The tokens kept exact in each merged chunk are the chunk's top-2 by the score the store computed."""
    from kvkit.policies.chelsea import Chelsea

    seen = _record_scores(monkeypatch)
    model = tiny_model("llama")
    kvkit.patch(model, "chelsea", ratio=0.5, protect=0.25, **SMALL)
    cache = kvkit.KVCache(model)
    with torch.no_grad():
        model(input_ids=_ids(40), past_key_values=cache, use_cache=True)
    kvkit.unpatch(model)
    score, pos = seen[0]
    s = _stores(cache)[0]
    chunks = (40 - 2 - 4) // 8
    assert s.n_merged == chunks * 4
    for h in range(score.shape[1]):
        exact = set(s.pos[0, h, : s.n_merged][s.size[0, h, : s.n_merged] == 1].tolist())
        for c in range(chunks):
            lo = 2 + 8 * c
            top = score[0, h, lo : lo + 8].topk(2).indices + lo
            assert set(pos[0, h, top].tolist()) <= exact, (h, c)
    with pytest.raises(ValueError, match="protect < ratio"):
        Chelsea(ratio=0.25, protect=0.25, chunk_size=8)
    with pytest.raises(ValueError, match="protect"):
        Chelsea(protect=1.5)


@pytest.mark.parametrize("kernel,pooling,window", [(7, "max", "centered"), (5, "avg", "trailing"), (3, "max", "trailing")])
def test_protection_score_pooling_matches_reference(monkeypatch, kernel, pooling, window):
    """The protection score: observation-window attention summed over the window's queries, pooled along the tokens
    with ``protect_kernel`` / ``protect_pooling`` / ``protect_window`` (trailing: the token and the kernel - 1
    before it; zeros beyond the ends), averaged over each KV head's query group -- written out here."""
    seen = []
    on_prefill = ChelseaStore.on_prefill

    def spy(self, query, module):
        if not seen:
            seen.append((query.clone(), self.keys.clone(), self.pos.clone(), self.seen))
        on_prefill(self, query, module)
        if len(seen) == 1:
            seen.append(self.score.clone() if self.score is not None else None)

    monkeypatch.setattr(ChelseaStore, "on_prefill", spy)
    monkeypatch.setattr(ChelseaStore, "compress", lambda self: None)  # keep the scored slots in place
    model = tiny_model("llama")
    kvkit.patch(model, "chelsea", ratio=0.5, protect=0.25, protect_kernel=kernel, protect_pooling=pooling,
                protect_window=window, **SMALL)
    cache = kvkit.KVCache(model)
    with torch.no_grad():
        model(input_ids=_ids(30), past_key_values=cache, use_cache=True)
    kvkit.unpatch(model)
    (query, keys, pos, n_seen), score = seen
    B, Hq, T, D = query.shape
    H, n = keys.shape[1], keys.shape[2]
    w = SMALL["window"]
    q = query[:, :, -w:].float()
    att = torch.zeros(B, Hq, n)
    for hq in range(Hq):
        for i in range(w):
            qp = n_seen - w + i
            s = (keys[:, hq // (Hq // H)].float() @ q[:, hq, i].unsqueeze(-1)).squeeze(-1) * D**-0.5
            s = s.masked_fill(pos[:, 0] > qp, float("-inf"))
            att[:, hq] += torch.softmax(s, -1)
    ref = torch.zeros(B, Hq, n)
    for j in range(n):
        lo, hi = (j - kernel + 1, j + 1) if window == "trailing" else (j - kernel // 2, j + kernel // 2 + 1)
        part = att[..., max(0, lo): min(n, hi)]
        if pooling == "max":
            ref[..., j] = part.amax(-1).clamp(min=0)
        else:
            ref[..., j] = part.sum(-1) / kernel
    ref = ref.view(B, H, Hq // H, n).mean(2)
    torch.testing.assert_close(score, ref, rtol=1e-5, atol=1e-6)


def test_default_protection_is_a_share_of_the_kept_slots_and_protect_0_is_the_paper():
    """protect=None (the default) protects PROTECT_SHARE (0.8) of a chunk's kept slots, at most all but one: the very
    cache of the explicit fraction; protect=0 and calibrated=False are the paper's matching (no score, no protection)."""
    from kvkit.policies.chelsea import Chelsea

    assert Chelsea.PROTECT_SHARE == 0.8
    model = tiny_model("llama")
    ids = _ids(70)

    def cache_of(**kw):
        kvkit.patch(model, "chelsea", ratio=0.5, **SMALL, **kw)
        cache = kvkit.KVCache(model)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        kvkit.unpatch(model)
        return [(s.keys, s.values, s.pos, s.size, s.p.protected_per_chunk) for s in _stores(cache)]

    default, explicit = cache_of(), cache_of(protect=3 / 8)  # 8-token chunks keep 4: min(ceil(0.8 * 4), 3) = 3
    paper, uncalibrated = cache_of(protect=0), cache_of(calibrated=False)
    for a, b, c, d in zip(default, explicit, paper, uncalibrated):
        assert a[4] == b[4] == 3 and c[4] == d[4] == 0
        assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4]))
        assert all(torch.equal(x, y) for x, y in zip(c[:4], d[:4]))
    assert any(not torch.equal(a[0], c[0]) for a, c in zip(default, paper))
    # a ratio too small to keep two slots of a chunk protects nothing (it would leave nothing to merge into)
    assert Chelsea(ratio=0.1, chunk_size=8).protected_per_chunk == 0
    with pytest.raises(ValueError, match=r"protect must be a fraction in \[0, 1\) \(0: the paper's matching\)"):
        Chelsea(protect="some")


RECON = dict(SMALL, ratio=0.5, protect_score="reconstruct", recon_chunk=10)


def test_reconstruct_protection_scores_the_repeat_and_keeps_its_best_exact(monkeypatch):
    """protect_score="reconstruct": merging waits for KVzip's reconstruction pass; the protection score of every
    prefill slot is the largest attention a repeat query of its KV group pays it (transformers' eager attention on
    the context followed by each chunk's repeat), and each merged chunk keeps its top slots by that score exact.
    The pass leaves no trace: the cache holds the 70 tokens, the prefill's logits are those of the window protection."""
    from kvkit.policies.chelsea import Chelsea
    from kvkit.testing import reconstruction_scores_reference

    model = tiny_model("llama", num_hidden_layers=2)  # GQA: 4 query heads over 2 KV heads
    seen = _record_scores(monkeypatch, layers=2)
    ids = _ids(70)
    with torch.no_grad():
        kvkit.patch(model, "chelsea", **dict(RECON, protect_score="window"))
        window_logits = model(input_ids=ids, use_cache=True).logits
        kvkit.unpatch(model)
        seen.clear()
        kvkit.patch(model, "chelsea", **RECON)
        cache = kvkit.KVCache(model)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        kvkit.unpatch(model)
        ref = reconstruction_scores_reference(model, ids, 10, Chelsea.RECON_OVERLAP)
    torch.testing.assert_close(logits, window_logits)
    assert cache.get_seq_length() == 70 and not cache.scoring_pass
    P = 3  # 8-token chunks keep 4: min(ceil(0.8 * 4), 3) protected
    for li, (st, (score, pos)) in enumerate(zip(_stores(cache), seen)):
        assert st.p.protected_per_chunk == P and st.num_slots() == 8 * 4 + 70 - 8 * 8
        assert torch.equal(pos[0, 0].long(), torch.arange(70))  # nothing merged before the pass
        torch.testing.assert_close(score[0], ref[li], rtol=1e-4, atol=1e-6)
        for h in range(score.shape[1]):
            exact = set(st.pos[0, h, : st.n_merged][st.size[0, h, : st.n_merged] == 1].tolist())
            for c in range(8):
                lo = 2 + 8 * c
                top = ref[li, h, lo : lo + 8].topk(P).indices + lo
                assert set(top.tolist()) <= exact, (li, h, c)


def test_reconstruct_protection_in_generate_batches_and_refusals():
    """A left-padded row keeps what it keeps alone (greedy tokens), generate() runs the pass, a replayed prefill
    (which would skip the pass) is refused, and embeddings without ids are refused with what to do."""
    from kvkit.evals.shared_prefill import replayable
    from kvkit.testing import greedy, left_padded_batch

    model = tiny_model("qwen2")
    ids, mask, prompts = left_padded_batch([60, 45], seed=2)
    kvkit.patch(model, "chelsea", **RECON)
    try:
        toks, _, _ = greedy(model, ids, 6, attention_mask=mask)
        for i, p in enumerate(prompts):
            alone, _, _ = greedy(model, p[None], 6)
            assert torch.equal(toks[i], alone[0]), i
        out = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 64)
        assert not replayable(kvkit.patched_policy(model))
        with torch.no_grad(), pytest.raises(ValueError, match="input_ids.*protect_score='window'"):
            model(inputs_embeds=model.get_input_embeddings()(ids[:1]), use_cache=True)
    finally:
        kvkit.unpatch(model)
    assert replayable("chelsea") and replayable("chelsea", {"ratio": 0.5})
    assert not replayable("chelsea", {"protect_score": "reconstruct"})
    assert replayable("chelsea", {"protect_score": "reconstruct", "protect": 0})  # nothing to protect: no pass
    with pytest.raises(ValueError, match="protect_score must be one of window, reconstruct"):
        kvkit.get_policy("chelsea", protect_score="question")
    with pytest.raises(ValueError, match="recon_chunk must be a positive integer"):
        kvkit.get_policy("chelsea", protect_score="reconstruct", recon_chunk=0)


def test_merge_free_equals_merge_chunks_over_the_unprotected_slots():
    """merge_free with the same number of frozen slots in every chunk is the chunk-scoped protection: the unprotected
    slots merged by merge_chunks down to target, the frozen ones kept as they are."""
    from kvkit.stores.merge import merge_free
    from kvkit.stores.merge import rows as _rows

    g = torch.Generator().manual_seed(0)
    B, H, C, L, D, P, K = 2, 3, 5, 16, 8, 3, 8
    k, v = torch.randn(B, H, C, L, D, generator=g), torch.randn(B, H, C, L, D, generator=g)
    pos, size = torch.arange(L).expand(B, H, C, L).contiguous(), torch.ones(B, H, C, L)
    prot = torch.zeros(B, H, C, L, dtype=torch.bool).scatter_(
        -1, torch.randn(B, H, C, L, generator=g).topk(P, -1).indices, True)
    order = prot.to(torch.int8).argsort(dim=-1, stable=True)
    sub = lambda x, idx: x.gather(-1, idx) if x.dim() == idx.dim() else _rows(x, idx)  # noqa: E731
    mk, mv, mp, ms = merge_chunks(*(sub(x, order[..., : L - P]) for x in (k, v, pos, size)), K - P)
    keep = order[..., L - P :]
    mk, mv = torch.cat([mk, _rows(k, keep)], -2), torch.cat([mv, _rows(v, keep)], -2)
    mp, ms = torch.cat([mp, pos.gather(-1, keep)], -1), torch.cat([ms, size.gather(-1, keep)], -1)
    srt = mp.argsort(dim=-1, stable=True)
    mk, mv, mp, ms = _rows(mk, srt), _rows(mv, srt), mp.gather(-1, srt), ms.gather(-1, srt)
    def by_position(fk, fp, fs, live):
        """Output slots laid out by position (the live ones; a frozen slot keeps its own position)."""
        idx = torch.where(live, fp, L).long()
        dense_k = torch.zeros(B, H, C, L + 1, D).scatter(-2, idx[..., None].expand(*idx.shape, D), fk)
        dense_s = torch.zeros(B, H, C, L + 1).scatter(-1, idx, torch.where(live, fs, 0.0))
        return dense_k[..., :L, :], dense_s[..., :L]

    fk, fv, fp, fs, live = merge_free(k, v, pos, size, prot, K - P)
    assert bool((live.sum(-1) == K).all())
    dk, ds = by_position(fk, fp, fs, live)
    assert bool((ds[prot] == 1).all()) and torch.equal(dk[prot], k[prot])  # frozen slots kept as they were
    s2 = torch.where(live, fp, 10**9).argsort(dim=-1, stable=True)[..., :K]
    assert torch.equal(fp.gather(-1, s2), mp) and torch.equal(fs.gather(-1, s2), ms)
    torch.testing.assert_close(_rows(fk, s2), mk)
    torch.testing.assert_close(_rows(fv, s2), mv)
    # uneven protection: each chunk merges its own free slots down to the same target, the frozen ones stay
    prot2 = prot.clone()
    prot2[..., 0, :] = False
    prot2[..., 0, :10] = True  # chunk 0 protects 10 of 16, the others 3
    fk, fv, fp, fs, live = merge_free(k, v, pos, size, prot2, K - P)
    assert torch.equal(live.sum(-1)[..., 0], torch.full((B, H), 10 + K - P))
    assert bool((live.sum(-1)[..., 1:] == K).all())
    assert torch.equal(fs[live].sum(), torch.tensor(float(B * H * C * L)))  # every token in one live slot
    dk, ds = by_position(fk, fp, fs, live)
    assert bool((ds[prot2] == 1).all()) and torch.equal(dk[prot2], k[prot2])


def test_context_scope_ranks_the_protection_over_the_merged_chunks(monkeypatch):
    """protect_scope="context": per KV head the P x chunks best slots of the chunks merged together stay exact (at
    most chunk - (K - P) of one chunk), so a chunk can keep more exact slots than a chunk keeps at all; a KV head
    holds the same slots as with the chunk scope, every token in one slot; a left-padded row keeps what it keeps
    alone."""
    from kvkit.testing import greedy, left_padded_batch

    seen = _record_scores(monkeypatch)
    model = tiny_model("llama")
    ids = _ids(70)
    slots = {}
    for scope in ("chunk", "context"):
        seen.clear()
        # protect_kernel 1: no pooling, so no tied scores (a max-pooled score ties neighbours)
        kvkit.patch(model, "chelsea", ratio=0.5, protect_scope=scope, protect_kernel=1, **SMALL)
        cache = kvkit.KVCache(model)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        kvkit.unpatch(model)
        slots[scope] = [s.num_slots() for s in _stores(cache)]
    s = _stores(cache)[0]
    score, pos = seen[0]
    C, L, K, P = 8, 8, 4, 3  # (70 - 2 sinks - 4 window) // 8 chunks; 8-token chunks keep 4, protect 3
    assert slots["chunk"] == slots["context"] and s.n_merged == C * K
    assert torch.equal(s.size.sum(-1), torch.full((1, 2), 70, dtype=torch.int64))
    most = 0
    for h in range(score.shape[1]):
        sc = score[0, h, 2 : 2 + C * L].view(C, L)
        elig = torch.zeros_like(sc, dtype=torch.bool).scatter_(-1, sc.topk(L - (K - P), -1).indices, True)
        top = sc.masked_fill(~elig, float("-inf")).flatten().topk(P * C).indices
        protected = {int(p) for p in pos[0, h, 2 + top]}
        exact = set(s.pos[0, h, : s.n_merged][s.size[0, h, : s.n_merged] == 1].tolist())
        assert protected <= exact, h
        most = max(most, int(torch.bincount(top // L, minlength=C).max()))
    assert most > K  # some chunk kept more tokens exact than the chunk scope lets a chunk keep slots
    kvkit.patch(model, "chelsea", ratio=0.5, protect_scope="context", **SMALL)
    try:
        bids, mask, prompts = left_padded_batch([60, 37], seed=4)
        toks, _, _ = greedy(model, bids, 6, attention_mask=mask)
        for i, p in enumerate(prompts):
            assert torch.equal(toks[i], greedy(model, p[None], 6)[0][0]), i
    finally:
        kvkit.unpatch(model)
    with pytest.raises(ValueError, match="protect_scope must be one of chunk, context"):
        kvkit.get_policy("chelsea", protect_scope="global")
