"""snapkv: observation-window scoring, pooling (avg / max, per-model kernel) on tiny random models."""

import pytest
import torch
import torch.nn.functional as F

import kvkit
from kvkit.policies.snapkv import SnapKVStore
from kvkit.testing import random_ids, tiny_model

BUDGET, WINDOW = 20, 4


def _capture(monkeypatch):
    """Record each layer's prefill query and key (post-RoPE, every prompt token) as the store sees them."""
    seen = {}
    orig = SnapKVStore.attend

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if self.info.layer_idx not in seen:
            seen[self.info.layer_idx] = (query.detach().clone(), key.detach().clone(), scaling)
        return orig(self, module, query, key, value, attention_mask, scaling, dropout, **kw)

    monkeypatch.setattr(SnapKVStore, "attend", attend)
    return seen


def _reference_scores(q, k, scaling, kernel, pooling, budget, window, pool_window="centered"):
    """SnapKV's selection written out: softmax of the last ``window`` queries over every prompt key (causal),
    summed over the window, pooled along the keys, averaged over each KV head's query group; the window's own
    tokens kept, the best ``budget - window`` of the others. Returns the scores ``[H, S]``."""
    Hq, S, _ = q.shape[1:]
    H = k.shape[1]
    g = Hq // H
    kk = k.repeat_interleave(g, dim=1)  # [1, Hq, S, D]
    s = (q[:, :, -window:] @ kk.transpose(-1, -2)).float() * scaling  # [1, Hq, w, S]
    qpos = torch.arange(S - window, S)[:, None]
    s = s.masked_fill(torch.arange(S)[None, :] > qpos, float("-inf"))
    a = torch.softmax(s, -1).sum(2)  # [1, Hq, S]
    if pool_window == "trailing":  # token j: the kernel tokens ending at j (zeros before the first)
        z = torch.cat([torch.zeros(*a.shape[:-1], kernel - 1), a], dim=-1)
        win = torch.stack([z[..., j : j + kernel] for j in range(S)], dim=-2)  # [1, Hq, S, kernel]
        a = win.mean(-1) if pooling == "avg" else win.amax(-1)
    elif pooling == "avg":
        a = F.avg_pool1d(a, kernel, stride=1, padding=kernel // 2)
    else:
        a = F.max_pool1d(a, kernel, stride=1, padding=kernel // 2)
    return a.view(1, H, g, S).mean(2)[0]  # [H, S]


@pytest.mark.parametrize("kernel, pooling, pool_window", [(3, "avg", "centered"), (7, "max", "centered"),
                                                         (5, "avg", "trailing"), (3, "max", "trailing")])
def test_prefill_keeps_what_the_reference_selection_keeps(monkeypatch, kernel, pooling, pool_window):
    model = tiny_model("llama", num_hidden_layers=2)  # GQA: 4 query heads over 2 KV heads
    seen = _capture(monkeypatch)
    kvkit.patch(model, "snapkv", budget=BUDGET, window=WINDOW, kernel=kernel, pooling=pooling, pool_window=pool_window)
    try:
        with torch.no_grad():
            out = model(random_ids(60), use_cache=True)
        cache = out.past_key_values
        for li, st in enumerate(cache.layers):
            q, k, scaling = seen[li]
            score = _reference_scores(q, k, scaling, kernel, pooling, BUDGET, WINDOW, pool_window)
            S = q.shape[2]
            for h in range(st.pos.shape[1]):
                got = sorted(st.pos[0, h].tolist())
                assert got[-WINDOW:] == list(range(S - WINDOW, S)), f"layer {li} head {h}: window not kept"
                # the others are a best-(budget - window) set (max pooling makes ties: compare scores, not ids)
                want = score[h, : S - WINDOW].topk(BUDGET - WINDOW).values.sort().values
                assert torch.allclose(score[h, got[:-WINDOW]].sort().values, want, atol=1e-6), f"layer {li} head {h}"
    finally:
        kvkit.unpatch(model)


def test_max_pooling_keeps_the_neighbours_of_an_attended_token():
    """A peak at one key: max pooling gives its kernel neighbours the peak's score, average pooling a fifth."""
    from kvkit.stores.scored import pool_group

    x = torch.zeros(1, 2, 21)
    x[..., 10] = 1.0
    mx = pool_group(x, 5, 1, mode="max")[0, 0]
    av = pool_group(x, 5, 1, mode="avg")[0, 0]
    assert mx[8:13].tolist() == [1.0] * 5 and mx[:8].sum() == 0 and mx[13:].sum() == 0
    assert av[8:13].tolist() == pytest.approx([0.2] * 5)


def test_trailing_window_gives_the_tokens_after_an_attended_token_its_score():
    """The trailing window (kvkit) reaches kernel - 1 tokens forward and none back: a needle's value after the
    key the question attends to is kept whole by a kernel as long as the value, where the centered window
    (the reference's) spends half its reach on the tokens before the key."""
    from kvkit.stores.scored import pool_group

    x = torch.zeros(1, 2, 21)
    x[..., 10] = 1.0
    tr = pool_group(x, 5, 1, mode="avg", window="trailing")[0, 0]
    assert tr[10:15].tolist() == pytest.approx([0.2] * 5) and tr[:10].sum() == 0 and tr[15:].sum() == 0
    trm = pool_group(x, 5, 1, mode="max", window="trailing")[0, 0]
    assert trm[10:15].tolist() == [1.0] * 5 and trm[:10].sum() == 0 and trm[15:].sum() == 0


def test_options_refused_with_what_to_do():
    with pytest.raises(ValueError, match="pooling must be 'avg' or 'max'"):
        kvkit.registry.policy_class("snapkv")(pooling="median")
    with pytest.raises(ValueError, match="kernel must be a positive odd integer"):
        kvkit.registry.policy_class("snapkv")(kernel=4)
    with pytest.raises(ValueError, match="kernel must be a positive odd integer"):
        kvkit.registry.policy_class("snapkv")(kernel=0)
    with pytest.raises(ValueError, match="calibrated must be true or false"):
        kvkit.registry.policy_class("snapkv")(calibrated="yes")
    with pytest.raises(ValueError, match="pool_window must be one of centered, trailing"):
        kvkit.registry.policy_class("snapkv")(pool_window="forward")
    # the paper's setting when nothing is calibrated for the model
    assert kvkit.registry.policy_class("snapkv")().settings(tiny_model("llama", num_hidden_layers=2).config) == (5, "avg", "centered")
