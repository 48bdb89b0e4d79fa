"""cake: CAKE cascading layer budgets and mean+variance eviction on tiny random models."""

import pytest
import torch

import kvkit
from kvkit.policies.cake import allocate, cascade_history, model_taus
from kvkit.testing import greedy_stacked as _run
from kvkit.testing import random_ids as _ids
from kvkit.testing import tiny_config, tiny_model

LAYERS = 4
SMALL = dict(budget=16, window=8, tail=4)  # total evictable (16 - 8) * 4 = 32 tokens
TOTAL = (SMALL["budget"] - SMALL["window"]) * LAYERS


def _model(arch="llama"):
    return tiny_model(arch, num_hidden_layers=LAYERS)


def _live(cache):
    """Live tokens per layer, row and KV head: [L, B, H]."""
    return torch.stack([s.live() for s in cache.layers])


def test_allocate_shares_caps_and_sum():
    pref = torch.tensor([[1.0, 2.0, 1.0], [1.0, 1.0, 100.0]], dtype=torch.float64)
    b = allocate(pref, 40, torch.tensor([100, 30]))
    assert b[0].tolist() == [10, 20, 10]
    assert b[1].tolist() == [5, 5, 30]  # capped at 30; the excess is spread over the others
    assert b.sum(-1).tolist() == [40, 40]
    b = allocate(pref, 40, torch.tensor([10, 10]))  # every layer capped: the total cannot be reached
    assert b.tolist() == [[10, 10, 10], [10, 10, 10]]
    b = allocate(torch.tensor([[1.0, 1.0, 1.0]]), 10, torch.tensor([100]))  # rounding remainder -> first layer
    assert b.tolist() == [[4, 3, 3]]
    assert allocate(torch.zeros(1, 2), 9, torch.tensor([100])).sum().item() == 9  # no preference: equal shares


def test_tau_table():
    from transformers import AutoConfig

    assert model_taus(tiny_config("llama"))[1] == "default"
    cfg = tiny_config("llama")
    cfg._name_or_path = "meta-llama/Llama-3.1-8B-Instruct"
    assert model_taus(cfg) == ((1.6, 0.4), "llama-3.1-8b")
    q = AutoConfig.for_model("qwen2", num_hidden_layers=28, hidden_size=3584, num_key_value_heads=4,
                             num_attention_heads=28, vocab_size=152064)
    assert model_taus(q) == ((1.5, 0.6), "qwen2.5-7b")  # found by shape, whatever the file name
    m = AutoConfig.for_model("mistral", num_hidden_layers=32, hidden_size=4096, num_key_value_heads=8, vocab_size=32768)
    assert model_taus(m)[0] == (0.8, 0.5)
    cache = kvkit.KVCache(_model(), "cake", tau2=0.7)
    assert (cache.layers[0].tau1, cache.layers[0].tau2) == (1.0, 0.7)


def test_budgets_per_layer_and_head_and_cascade():
    model = _model()
    ids = _ids(90)
    kvkit.patch(model, "cake", **SMALL)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    w = SMALL["window"]
    hist = cascade_history(cache)
    assert len(hist) == LAYERS
    prev = {}
    for m, step in enumerate(hist):
        assert sorted(step) == list(range(m + 1))
        held = sum(int(b.sum()) for b in step.values())
        assert held <= TOTAL  # never more than B evictable tokens (+ the windows) held
        for i, b in step.items():
            assert i not in prev or bool((b <= prev[i]).all())  # budgets only shrink
            prev[i] = b
    assert sum(int(b.sum()) for b in hist[-1].values()) == TOTAL
    final = torch.stack([hist[-1][i] for i in range(LAYERS)])  # [L, B]
    live = _live(cache)  # [L, B, H]
    assert torch.equal(live, (final + w)[:, :, None].expand_as(live))  # every KV head holds its layer budget
    assert len(set(final[:, 0].tolist())) > 1  # budgets really differ between layers
    for s in cache.layers:
        assert s.score is None  # prefill indicators freed after the last layer
        assert s.pos.shape[1] == 2  # per-head positions
        last = torch.arange(90 - w, 90, dtype=s.pos.dtype)
        assert bool(torch.isin(last, s.pos).all())  # the window is always kept
        for h in range(2):  # positions are distinct and sorted per head
            p = s.pos[0, h][s.pos[0, h] >= 0]
            assert bool((p[1:] > p[:-1]).all())
    # decode: each layer stays within its size + tail, evicting in bulk
    toks = out.logits[:, -1].argmax(-1, keepdim=True)
    with torch.no_grad():
        for _ in range(13):
            toks = model(input_ids=toks, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            live = _live(cache)
            assert bool((live <= (final + w + SMALL["tail"])[:, :, None]).all())
    assert int(_live(cache)[:, 0, 0].sum()) <= TOTAL + LAYERS * (w + SMALL["tail"])  # one row, one head
    kvkit.unpatch(model)


def test_nothing_evicted_at_budget_plus_window():
    model = _model()
    kvkit.patch(model, "cake", **SMALL)
    with torch.no_grad():
        cache = model(input_ids=_ids(24), use_cache=True).past_key_values  # 24 = budget + window
    kvkit.unpatch(model)
    assert cache.num_slots() == [24] * LAYERS and int(_live(cache).min()) == 24


def test_evicting_changes_decode_but_not_prefill():
    model = _model()
    ids = _ids(90)
    _, ref_logits, _ = _run(model, ids, steps=3)
    kvkit.patch(model, "cake", **SMALL)
    _, logits, cache = _run(model, ids, steps=3)
    kvkit.unpatch(model)
    torch.testing.assert_close(logits[:, 0], ref_logits[:, 0])  # prefill attention is exact
    assert not torch.allclose(logits[:, 1:], ref_logits[:, 1:], atol=1e-4)
    full_bytes = LAYERS * 2 * 93 * 16 * 4 * 2
    assert cache.nbytes() < full_bytes / 2


@pytest.mark.parametrize("opts,match", [
    (dict(budget=32), r"budget \(32\) must be larger than window \(32\)"),
    (dict(budget=0), "budget must be a positive integer"),
    (dict(window=0), "window must be a positive integer"),
    (dict(pool_kernel=4), "pool_kernel must be a positive odd integer"),
    (dict(tail=33), "tail .* must be at most window"),
    (dict(gamma=-1.0), "gamma must be a non-negative number"),
    (dict(tau1=0), "tau1 must be a positive number"),
    (dict(tau2=float("nan")), "tau2 must be a positive number"),
])
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        kvkit.patch(_model(), "cake", **opts)
