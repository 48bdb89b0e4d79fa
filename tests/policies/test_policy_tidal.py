"""tidal: TidalDecode sparse decode reads on tiny random models (6 layers: full, full, select, reuse,
select, reuse)."""

import pytest
import torch

import kvkit
from kvkit.kernels import gather_attend
from kvkit.policies.tidal import TidalStore, decode_read_bytes
from kvkit.stores import attend_slots
from kvkit.testing import greedy_stacked as _run
from kvkit.testing import left_padded_batch, tiny_model
from kvkit.testing import random_ids as _ids

LAYERS = 6  # default reselect_layer = max(round(0.4 * 6), 4) = 4
ROW = 2 * 16 * 4  # one K row + one V row, head_dim 16, fp32


def _model(arch="llama"):
    return tiny_model(arch, num_hidden_layers=LAYERS)


def test_roles_and_default_reselect():
    cache = kvkit.KVCache(_model(), "tidal")
    assert [s.role for s in cache.layers] == ["full", "full", "select", "reuse", "select", "reuse"]
    from kvkit.policies.tidal import Tidal

    assert Tidal().reselect_for(32) == 13  # the paper's layer 13 of 32 (Llama-3-8B)
    assert Tidal().reselect_for(30) == 12
    assert Tidal().reselect_for(4) is None
    cache = kvkit.KVCache(_model(), "tidal", reselect_layer=3)
    assert [s.role for s in cache.layers] == ["full", "full", "select", "select", "reuse", "reuse"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("selection", ["q_head", "kv_head", "shared"])
def test_budget_covering_context_equals_full(arch, selection):
    model = _model(arch)
    ids = _ids(40)
    ref_toks, ref_logits, _ = _run(model, ids)
    kvkit.patch(model, "tidal", budget=64, selection=selection)
    toks, logits, cache = _run(model, ids)
    kvkit.unpatch(model)
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    r = decode_read_bytes(cache)
    assert r["read"] == r["full"]  # a covering budget reads everything


@pytest.mark.parametrize("selection", ["q_head", "kv_head", "shared"])
def test_sparse_path_with_covering_selection_equals_full(selection, monkeypatch):
    """The gather path itself (no dense shortcut) is exact when the selection covers every token."""
    monkeypatch.setattr(TidalStore, "decode", _decode_no_shortcut)
    model = _model()
    ids = _ids(30)
    ref_toks, ref_logits, _ = _run(model, ids, steps=6)
    kvkit.patch(model, "tidal", budget=64, selection=selection)
    toks, logits, cache = _run(model, ids, steps=6)
    kvkit.unpatch(model)
    assert cache.shared.idx is not None  # the selection really was shared
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def _decode_no_shortcut(self, query, qpos, scaling):
    """TidalStore.decode without the `budget >= n - 1` dense shortcut."""
    if self.role == "full":
        return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling)
    sel = self.info.shared
    if self.role == "select" or sel.idx is None or sel.seen != self.seen:
        return self._select(query, qpos, scaling)
    return self._reuse(query, sel, scaling)


@pytest.mark.parametrize("c_kernel", ["1", "0"])  # kvkit/kernels/decode_cpu.sparse_attn, or index_select + bmm
@pytest.mark.parametrize("D", [16, 64])  # 64: the C kernel's vector path
def test_gather_attend_matches_masked_dense(c_kernel, D, monkeypatch):
    monkeypatch.setenv("KVKIT_DECODE_CPU", c_kernel)
    torch.manual_seed(0)
    B, Hq, H, T, n, k = 2, 4, 2, 3, 20, 5
    q = torch.randn(B, Hq, T, D)
    kbuf, vbuf = torch.randn(B, H, n + 7, D), torch.randn(B, H, n + 7, D)
    keys, values = kbuf[:, :, :n], vbuf[:, :, :n]  # a prefix of a preallocated buffer, read in place
    pos = torch.arange(n, dtype=torch.int32).view(1, 1, n).expand(B, 1, n)
    qpos = torch.arange(n - T, n, dtype=torch.int32)
    for Hs in (Hq, H):
        idx = torch.stack([torch.randperm(n - T)[:k] for _ in range(B * Hs * T)]).view(B, Hs, T, k)
        valid = torch.ones_like(idx, dtype=torch.bool)
        valid[..., -1] = False
        out = gather_attend(q, keys, values, idx, valid, 0.25)
        # dense reference: per query head, a mask of its rows
        m = torch.zeros(B, Hs, T, n, dtype=torch.bool).scatter_(-1, idx, valid)
        m = m.repeat_interleave(Hq // Hs, dim=1) if Hs == H else m
        ref = torch.stack([
            attend_slots(q[:, h : h + 1], keys[:, h * H // Hq : h * H // Hq + 1], values[:, h * H // Hq : h * H // Hq + 1],
                         pos, qpos, 0.25, m[:, h : h + 1])[:, :, 0]
            for h in range(Hq)
        ], dim=2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selection,rows_per_layer", [("q_head", 4), ("kv_head", 2), ("shared", 2)])
def test_read_counter_formula(selection, rows_per_layer):
    model = _model()
    ids = _ids(40)
    k = 8
    kvkit.patch(model, "tidal", budget=k, selection=selection)
    _, _, cache = _run(model, ids, steps=1)
    kvkit.unpatch(model)
    n = 41  # prompt + one decoded token held at the decode step
    full_layer = 2 * n * ROW  # 2 KV heads read every held row
    sparse_layer = rows_per_layer * (k + 1) * ROW  # (k selected + current) per index list
    r = decode_read_bytes(cache)
    assert [s.read_nbytes() for s in cache.layers] == [full_layer] * 3 + [sparse_layer, full_layer, sparse_layer]
    assert r["read"] == 4 * full_layer + 2 * sparse_layer
    assert r["full"] == 6 * full_layer
    # every layer held every token: no memory saved
    assert cache.num_slots() == [n] * LAYERS


def test_reads_at_8k_with_budget_2048_formula():
    """Read ratio of the default budget at 8K on SmolLM2's shape (30 layers, 9/3 heads), from the counter
    formula: the 4 full-read layers (0, 1, 2 and the re-selection layer) bound the ratio."""
    from kvkit.policies.tidal import Tidal

    L, Hq, H, n, k = 30, 9, 3, 8192, 2048
    r = Tidal().reselect_for(L)
    full_layers = 3 + (r is not None)
    for rows, expected in ((H, 2.86), (Hq, 1.28)):  # kv_head, q_head
        read = full_layers * H * n + (L - full_layers) * rows * (k + 1)
        assert round(L * H * n / read, 2) == expected


@pytest.mark.parametrize("selection", ["q_head", "kv_head", "shared"])
def test_multi_token_forward_equals_single_steps_and_crop_is_exact(selection):
    model = _model()
    ids = _ids(40)
    kvkit.patch(model, "tidal", budget=6, selection=selection)
    with torch.no_grad():
        # reference: 4 single-token steps
        c1 = kvkit.KVCache(model)
        model(input_ids=ids, past_key_values=c1, use_cache=True)
        draft = _ids(4, seed=7)
        singles = [model(input_ids=draft[:, i : i + 1], past_key_values=c1, use_cache=True).logits[:, -1]
                   for i in range(4)]
        # one 4-token forward (speculative verification)
        c2 = kvkit.KVCache(model)
        model(input_ids=ids, past_key_values=c2, use_cache=True)
        multi = model(input_ids=draft, past_key_values=c2, use_cache=True).logits
        torch.testing.assert_close(multi[0], torch.cat(singles), rtol=1e-4, atol=1e-4)
        # roll back 3 tokens, continue: same as a cache that only ever saw the first draft token
        c2.crop(-3)
        c3 = kvkit.KVCache(model)
        model(input_ids=ids, past_key_values=c3, use_cache=True)
        model(input_ids=draft[:, :1], past_key_values=c3, use_cache=True)
        for a, b in zip(c2.layers, c3.layers):
            assert a.seen == b.seen and torch.equal(a.pos, b.pos)
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)  # a 4-token matmul vs a 1-token one
        nxt = _ids(1, seed=9)
        la = model(input_ids=nxt, past_key_values=c2, use_cache=True).logits
        lb = model(input_ids=nxt, past_key_values=c3, use_cache=True).logits
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    kvkit.unpatch(model)


@pytest.mark.parametrize("shares", [None, [1, 1, 1, 0.5, 1, 1.5]])  # layer_shares: smaller cuts, masked padding
@pytest.mark.parametrize("selection", ["q_head", "kv_head", "shared"])
def test_left_padded_batch_equals_single(selection, shares):
    model = _model()
    ids, mask, prompts = left_padded_batch([40, 27], seed=3)
    opts = {} if shares is None else dict(select_layers=[2], layer_shares=shares)
    kvkit.patch(model, "tidal", budget=8, selection=selection, **opts)
    toks, logits, _ = _run(model, ids, steps=8, mask=mask)
    for i, p in enumerate(prompts):
        t1, l1, _ = _run(model, p[None], steps=8)
        assert torch.equal(toks[i], t1[0])
        torch.testing.assert_close(logits[i], l1[0], rtol=1e-4, atol=1e-4)
    kvkit.unpatch(model)


def test_small_budget_differs_from_full_and_reads_less():
    model = _model()
    ids = _ids(60)
    _, ref_logits, _ = _run(model, ids, steps=4)
    kvkit.patch(model, "tidal", budget=4, selection="kv_head")
    _, logits, cache = _run(model, ids, steps=4)
    kvkit.unpatch(model)
    assert not torch.allclose(logits[:, 1:], ref_logits[:, 1:], atol=1e-4)  # decode really is sparse
    torch.testing.assert_close(logits[:, 0], ref_logits[:, 0])  # prefill is exact
    r = decode_read_bytes(cache)
    assert r["ratio"] > 1.4
    assert cache.read_nbytes() == r["read"] < cache.nbytes()  # what `kvkit bench` reports per step


def test_long_chunk_is_exact_full_attention():
    model = _model()
    ids = _ids(70)
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, -1]
        kvkit.patch(model, "tidal", budget=4)
        cache, logits = kvkit.prefill(model, ids, chunk_size=35)  # two chunks of 35 > MAX_SPARSE_CHUNK
        kvkit.unpatch(model)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("opts,match", [
    (dict(budget=0), "budget must be a positive integer"),
    (dict(budget=1.5), "budget must be a positive integer"),
    (dict(selection="head"), "selection must be one of"),
    (dict(kv_reduce="mean"), "kv_reduce must be one of"),
    (dict(select_attention="selected"), "select_attention"),  # removed: worse than the paper's
    (dict(reselect_layer=2), r"reselect_layer must be in \[3, 5\]"),
    (dict(reselect_layer=6), r"reselect_layer must be in \[3, 5\]"),
])
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        kvkit.patch(_model(), "tidal", **opts)


def test_select_layers_roles_and_equivalence():
    """select_layers lists every selection layer; (2, r) is the paper's layout with reselect_layer=r."""
    cache = kvkit.KVCache(_model(), "tidal", select_layers=[1, 3])
    assert [s.role for s in cache.layers] == ["full", "select", "reuse", "select", "reuse", "reuse"]
    cache = kvkit.KVCache(_model(), "tidal", select_layers=(2, 3, 5))
    assert [s.role for s in cache.layers] == ["full", "full", "select", "select", "reuse", "select"]
    model = _model()
    ids = _ids(50)
    outs = []
    for opts in (dict(reselect_layer=4), dict(select_layers=[2, 4])):
        kvkit.patch(model, "tidal", budget=6, selection="kv_head", **opts)
        toks, logits, _ = _run(model, ids, steps=5)
        outs.append((toks, logits))
    kvkit.unpatch(model)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("opts,match", [
    (dict(select_layers=[]), "strictly increasing"),
    (dict(select_layers=[3, 2]), "strictly increasing"),
    (dict(select_layers=[2, 2]), "strictly increasing"),
    (dict(select_layers=[-1, 2]), "strictly increasing"),
    (dict(select_layers="2,4"), "strictly increasing"),
    (dict(select_layers=[2, 6]), "must be < 6"),
    (dict(select_layers=[2, 4], reselect_layer=4), "not both"),
])
def test_bad_select_layers(opts, match):
    with pytest.raises(ValueError, match=match):
        kvkit.patch(_model(), "tidal", **opts)


def test_decode_past_headroom_equals_full():
    """More decode steps than the buffers' headroom (re-allocation) and a rollback in the middle: still exactly
    the full cache's output when the budget covers everything."""
    from kvkit.stores import SlotStore

    HEADROOM = SlotStore.headroom
    model = _model()
    ids = _ids(20)
    steps = HEADROOM + 10
    ref_toks, ref_logits, _ = _run(model, ids, steps=steps)
    kvkit.patch(model, "tidal", budget=4096)
    toks, logits, cache = _run(model, ids, steps=steps)
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    store = cache.layers[3]
    kbuf = store._bufs["keys"]
    assert store.keys.data_ptr() == kbuf.data_ptr() and kbuf.shape[2] >= store.keys.shape[2]
    n = cache.get_seq_length()
    cache.crop(-5)
    with torch.no_grad():
        out = model(toks[:, -5:-4], past_key_values=cache, use_cache=True)  # writes over a cropped slot
    assert cache.get_seq_length() == n - 4
    assert store.keys.data_ptr() == store._bufs["keys"].data_ptr()
    kvkit.unpatch(model)
    assert torch.isfinite(out.logits).all()


def test_gather_attend_triton_path_matches_torch(monkeypatch):
    """The reuse layers' two paths (Triton sparse_decode on CUDA, index_select + sdpa elsewhere) agree;
    the Triton one runs under TRITON_INTERPRET here."""
    from tests._kernel_utils import HAS_TRITON, INTERPRET

    if not (HAS_TRITON and INTERPRET):
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    torch.manual_seed(1)
    B, Hq, H, T, n, D, k = 2, 4, 2, 2, 30, 16, 7
    q, keys, values = torch.randn(B, Hq, T, D), torch.randn(B, H, n, D), torch.randn(B, H, n, D)
    for Hs in (Hq, H):
        idx = torch.stack([torch.randperm(n)[:k].sort().values for _ in range(B * Hs * T)]).view(B, Hs, T, k)
        valid = torch.rand(B, Hs, T, k) > 0.2
        valid[..., 0] = True
        want = gather_attend(q, keys, values, idx, valid, 0.25)
        monkeypatch.setenv("KVKIT_KERNELS", "triton")
        got = gather_attend(q, keys, values, idx, valid, 0.25)
        monkeypatch.delenv("KVKIT_KERNELS")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- layer_shares: per-layer budgets of the reuse layers (kvkit) ----------------------------------------------
def test_layer_budgets_keep_the_mean_and_only_move_reuse_layers():
    from kvkit.policies.tidal import Tidal

    p = Tidal(budget=10, select_layers=(2, 4), layer_shares=[1, 1, 1, 0.5, 1, 1.5])  # reuse layers 3 and 5
    assert p.layer_budgets(6) == [10, 10, 10, 5, 10, 15]
    assert p.select_budget(6, 2) == 5 and p.select_budget(6, 4) == 15  # the largest budget reading each selection
    assert Tidal(budget=10, select_layers=(2, 4), layer_shares=[3] * 6).layer_budgets(6) == [10] * 6  # scale-free
    assert Tidal(budget=10, select_layers=(2, 4)).layer_budgets(6) == [10] * 6  # None: uniform, the paper


@pytest.mark.parametrize("opts,match", [
    (dict(layer_shares=[1, 1, 1, 0, 1, 1]), "positive numbers"),
    (dict(layer_shares=[1, 1, 1, -1, 1, 1]), "positive numbers"),
    (dict(layer_shares="1,1"), "positive numbers"),
    (dict(layer_shares=[1, 1, 1, True, 1, 1]), "positive numbers"),
    (dict(layer_shares=[1, 1, 1]), "one share per model layer"),
])
def test_bad_layer_shares(opts, match):
    with pytest.raises(ValueError, match=match):
        kvkit.patch(_model(), "tidal", **opts)


@pytest.mark.parametrize("selection", ["q_head", "kv_head", "shared"])
def test_layer_shares_each_reuse_layer_reads_its_top_k_of_the_ranking(selection, monkeypatch):
    """Layer 2 selects for reuse layers 3, 4, 5 with budgets 4, 8, 12 (budget 8, shares 0.5 / 1 / 1.5): it ranks 12
    tokens once; each reuse layer reads exactly the highest-scored k of that ranking plus the current token (the
    smaller cuts in score order, the whole selection in slot order), its output is attention over those rows, and the
    read counter counts them."""
    seen = {}
    orig = TidalStore._reuse

    def spy(self, query, sel, scaling):
        out = orig(self, query, sel, scaling)
        idx, valid = sel.view(self.budget, query.device)
        seen[self.info.layer_idx] = (idx.clone(), sel.ranked.clone(), self.read_nbytes(), valid,
                                     torch.allclose(out, gather_attend(query, self.keys, self.values,
                                                                       idx.sort(dim=-1).values, None, scaling)))
        return out

    monkeypatch.setattr(TidalStore, "_reuse", spy)
    model = _model()
    kvkit.patch(model, "tidal", budget=8, selection=selection, select_layers=[2], layer_shares=[1, 1, 1, 0.5, 1, 1.5])
    _run(model, _ids(40), steps=2)
    kvkit.unpatch(model)
    rows = 4 if selection == "q_head" else 2  # lists per layer (query heads, or KV heads)
    for layer, k in ((3, 4), (4, 8), (5, 12)):
        idx, ranked, read, valid, same_out = seen[layer]
        assert valid is None and idx.shape[-1] == k + 1 and ranked.shape[-1] == 12
        assert torch.equal(idx[..., :-1].sort(dim=-1).values, ranked[..., :k].sort(dim=-1).values)  # the top k
        assert bool((idx[..., -1] == 41).all())  # then the current token (slot 41 at the second decode step)
        assert read == rows * (k + 1) * ROW
        assert same_out  # the order of the rows does not matter


def test_equal_layer_shares_equal_uniform():
    model = _model()
    ids = _ids(50)
    outs = []
    for opts in (dict(), dict(layer_shares=[2.5] * LAYERS)):
        kvkit.patch(model, "tidal", budget=6, selection="kv_head", **opts)
        outs.append(_run(model, ids, steps=5)[:2])
    kvkit.unpatch(model)
    assert torch.equal(outs[0][0], outs[1][0])  # the same rows read (in score order with shares: sums reordered)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


def _round_robin(lists, oks, k):
    """Reference for ``union_ranks``: every head's first choice, then every head's second, ... duplicates and
    invalid entries skipped, the first ``k``."""
    out = []
    for r in range(len(lists[0])):
        for h in range(len(lists)):
            x = lists[h][r]
            if oks[h][r] and x not in out:
                out.append(x)
    return out[:k]


@pytest.mark.parametrize("masked", [False, True])
def test_union_ranks_is_the_round_robin_merge_of_the_heads_lists(masked):
    """selection="shared": one list per query token made of the query heads' rankings taken rank by rank (a token
    only one head ranks first is in it), the same list for every KV head; with masked candidates only real ones."""
    from kvkit.policies.tidal import union_ranks

    g = torch.Generator().manual_seed(5)
    B, Hq, T, m, k, H = 2, 6, 3, 30, 9, 2
    idx = torch.stack([torch.randperm(m, generator=g)[:k] for _ in range(B * Hq * T)]).view(B, Hq, T, k)
    ok = None
    if masked:  # a head's invalid entries sit at the end of its list (-inf scores rank last)
        n_ok = torch.randint(0, k + 1, (B, Hq, T, 1), generator=g)
        ok = torch.arange(k).view(1, 1, 1, k) < n_ok
    ranked, ranked_ok = union_ranks(idx, ok, m, H)
    assert ranked.shape == (B, H, T, k) and torch.equal(ranked[:, 0], ranked[:, 1])
    assert (ranked_ok is None) == (not masked)
    for b in range(B):
        for t in range(T):
            oks = ok[b, :, t].tolist() if masked else [[True] * k] * Hq
            want = _round_robin(idx[b, :, t].tolist(), oks, k)
            got = ranked[b, 0, t].tolist()
            if masked:
                real = ranked_ok[b, 0, t]
                assert int(real.sum()) == len(want)
                got = [x for x, r in zip(got, real.tolist()) if r]
            assert got == want
            if not masked:  # each head's top k // Hq tokens are in the shared list
                for h in range(Hq):
                    assert set(idx[b, h, t, : k // Hq].tolist()) <= set(got)


def test_shared_selection_reads_one_list_for_every_head():
    """selection="shared": every KV head of a reuse layer reads the same budget + 1 slots."""
    model = _model()
    kvkit.patch(model, "tidal", budget=8, selection="shared")
    _, _, cache = _run(model, _ids(40), steps=2)
    kvkit.unpatch(model)
    idx = cache.shared.idx
    assert idx.shape[1] == 2 and torch.equal(idx[:, 0], idx[:, 1]) and idx.shape[-1] == 9
    assert len(set(idx[0, 0, 0, :-1].tolist())) == 8  # 8 distinct tokens before the current one


@pytest.mark.parametrize("selection", ["q_head", "kv_head", "shared"])
def test_selection_layer_computes_in_the_cache_dtype_without_an_fp32_copy_of_kv(selection):
    """A bf16 selection layer: both matmuls in bf16 as transformers' eager attention does (softmax and ranking in
    fp32), no fp32 tensor as large as the layer's K, and the output that of eager-precision attention."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _model().to(torch.bfloat16)
    kvkit.patch(model, "tidal", budget=8, selection=selection)
    try:
        _, _, cache = _run(model, _ids(40), steps=2)
    finally:
        kvkit.unpatch(model)
    st = next(s for s in cache.layers if s.role == "select")
    B, H, n, D = st.keys.shape
    Hq = model.config.num_attention_heads
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    qpos = torch.tensor([n - 1])
    scaling = D ** -0.5

    class Fp32Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                self.numels.append(out.numel())
            return out

    with Fp32Outputs() as rec:
        out = st._select(q, qpos, scaling)
    assert rec.numels and max(rec.numels) < st.keys.numel()  # fp32 scores only: [B, H, G, n], G < D
    assert out.dtype == torch.bfloat16 and out.shape == (B, 1, Hq, D)
    G = Hq // H
    s = torch.matmul(q.reshape(B, H, G, D), st.keys.transpose(-1, -2)).float() * scaling
    ref = torch.matmul(torch.softmax(s, -1).to(torch.bfloat16), st.values).view(B, Hq, 1, D).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
