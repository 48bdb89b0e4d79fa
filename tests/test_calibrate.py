"""Per-model calibration files (kvkit.calibrate.store) and the knob calibrations (kvkit.calibrate.knobs)."""

from __future__ import annotations

import json

import pytest
import torch

import kvkit
from kvkit.calibrate import store
from kvkit.testing import greedy, tiny_model


class WordTokenizer:
    """Deterministic toy tokenizer for the tiny models (vocab 128): one id per word."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [2 + sum(map(ord, w)) % 126 for w in text.split()] or [2]


@pytest.fixture
def caldir(tmp_path, monkeypatch):
    """An empty calibration folder searched first; the user folder is moved into tmp_path too."""
    d = tmp_path / "cal"
    d.mkdir()
    monkeypatch.setenv("KVKIT_CALIBRATION_DIR", str(d))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store._CACHE.clear()
    return d


def _write(path, model, policies):
    data = {"format": store.FORMAT, "version": store.VERSION, "model": store.identity(model.config, "tiny"),
            "policies": policies}
    path.write_text(json.dumps(data))
    return path


def _section(**options):
    return {"options": options, "command": "test", "date": "2026-11-23"}


def _ids(n, seed=3):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_identity_and_shipped_default_model_file():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3)
    path = store.shipped_dir() / "smollm2-135m-instruct.json"
    if not path.exists():
        pytest.skip("no shipped calibration for the default model yet")
    data = store.read(path)
    assert store.matches(data["model"], store.identity(cfg))
    for name in ("tidal", "shadowkv", "zipcache"):
        if name in data["policies"]:
            sec = data["policies"][name]
            assert sec["command"].startswith("kvkit calibrate ") and sec["date"]
            assert store.lookup(cfg, name)[1] == path


def test_calibrated_settings_found_from_config(caldir):
    model = tiny_model("llama", num_hidden_layers=6)
    _write(caldir / "tiny.json", model, {"tidal": _section(select_layers=[1, 4]), "shadowkv": _section(rank=24),
                                          "zipcache": _section(key_bits=8, high_bits=8, low_bits=4, high_ratio=0.5)})
    cfg = model.config
    pol = kvkit.registry.policy_class("tidal")(budget=8)
    assert store.resolve(pol, cfg).selection_layers(6) == (1, 4)
    # the paper's layout stays one option away, and a user's own setting is never mixed with the calibration
    assert store.resolve(kvkit.registry.policy_class("tidal")(budget=8, calibrated=False), cfg).selection_layers(6) == (2, 4)
    assert store.resolve(kvkit.registry.policy_class("tidal")(budget=8, reselect_layer=3), cfg).selection_layers(6) == (2, 3)
    sk = kvkit.registry.policy_class("shadowkv")
    assert store.resolve(sk(), cfg).rank_for(32) == 24
    assert store.resolve(sk(calibrated=False), cfg).rank_for(32) == 5  # round(160/1024 * 32)
    zc = store.resolve(kvkit.registry.policy_class("zipcache")(), cfg)
    assert (zc.key_bits, zc.high_bits, zc.low_bits, zc.high_ratio) == (8, 8, 4, 0.5)
    paper = store.resolve(kvkit.registry.policy_class("zipcache")(calibrated=False), cfg)
    assert (paper.key_bits, paper.high_bits, paper.low_bits, paper.high_ratio) == (None, 4, 2, 0.6)
    # another model (other sizes) does not pick the file up
    other = tiny_model("llama", num_hidden_layers=5)
    assert store.lookup(other.config, "tidal") is None
    # through kvkit.patch: the stores use the calibrated layers
    kvkit.patch(model, "tidal", budget=8)
    cache = kvkit.KVCache(model)
    assert [layer.role for layer in cache.layers] == ["full", "select", "reuse", "reuse", "select", "reuse"]
    greedy(model, _ids(40), 3)
    kvkit.unpatch(model)
    kvkit.patch(model, "shadowkv", budget=16, min_prompt=16)
    assert {layer.rank for layer in kvkit.KVCache(model).layers} == {24}
    kvkit.unpatch(model)


def test_calibrated_cake_taus_found_from_config(caldir):
    """CAKE's taus: the calibration first, then the paper's table / (1, 1); user taus and calibrated=False win."""
    from kvkit.policies.cake import CakeStore

    model = tiny_model("llama", num_hidden_layers=4)
    _write(caldir / "tiny.json", model, {"cake": _section(tau1=2.0, tau2=0.5)})
    cake = kvkit.registry.policy_class("cake")
    assert store.resolve(cake(budget=16, window=4), model.config).taus(model.config) == (2.0, 0.5)
    assert store.resolve(cake(budget=16, window=4, calibrated=False), model.config).taus(model.config) == (1.0, 1.0)
    assert store.resolve(cake(budget=16, window=4, tau1=3.0), model.config).taus(model.config) == (3.0, 1.0)
    kvkit.patch(model, "cake", budget=16, window=4)
    stores = [layer for layer in kvkit.KVCache(model).layers if isinstance(layer, CakeStore)]
    assert stores and {(st.tau1, st.tau2) for st in stores} == {(2.0, 0.5)}
    greedy(model, _ids(40), 3)
    kvkit.unpatch(model)
    _write(caldir / "tiny.json", model, {"cake": _section(tau1=-1.0, tau2=0.5)})
    store._CACHE.clear()
    with pytest.raises(ValueError, match="tau1"):
        kvkit.patch(model, "cake", budget=16, window=4)
        kvkit.KVCache(model)
    kvkit.unpatch(model)


def test_calibrate_cake_sweeps_the_taus(monkeypatch):
    """The sweep tries the paper's taus first and keeps the pair answering most needles (ties: the paper's)."""
    from kvkit.calibrate import knobs, needles

    seen = []

    def fake_score(model, tok, data, specs, log=print):
        seen.extend(specs)
        answered = {"2.0,0.5": [1, 1, 0], "0.5,0.5": [1, 1, 0]}
        return {"full": [1, 1, 1], "predictions": {}, **{s[0]: answered.get(s[0], [1, 0, 0]) for s in specs}}

    monkeypatch.setattr(needles, "score_policies", fake_score)
    monkeypatch.setattr(needles, "make_samples", lambda tok, n, length, seed=0: [None] * 3)
    model = tiny_model("llama", num_hidden_layers=4)
    opts, ev = knobs.calibrate_cake(model, None, length=256, samples=3, budget_fraction=0.5, log=lambda m: None)
    assert seen[0][0] == "1.0,1.0" and all(sp[2]["budget"] == 128 for sp in seen)
    assert opts == {"tau1": 0.5, "tau2": 0.5}  # first of the two best in candidate order
    assert ev["per_taus"]["2.0,0.5"] == {"answered": 2, "of": 3} and ev["paper_taus"] == [1.0, 1.0]


@pytest.mark.parametrize("content, why", [
    ("{not json", "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"format": "other", "version": 1}', "'format' must be"),
    ('{"format": "kvkit-calibration", "version": 1, "model": {"model_type": "llama"}, "policies": {}}',
     "'model' lacks num_hidden_layers"),
    (None, "may set only select_layers, reselect_layer"),
    (None, "refused by the policy: tidal: select_layers must be"),
    (None, "policies.shadowkv.options must be a non-empty object"),
])
def test_malformed_calibration_file_refused(caldir, content, why):
    model = tiny_model("llama", num_hidden_layers=6)
    path = caldir / "bad.json"
    if content is not None:
        path.write_text(content)
    elif "may set only" in why:
        _write(path, model, {"tidal": _section(budget=16)})
    elif "refused by the policy" in why:
        _write(path, model, {"tidal": _section(select_layers=[4, 2])})
    else:
        _write(path, model, {"shadowkv": {"options": {}}})
    with pytest.raises(ValueError, match="calibration file .*bad.json.* is malformed") as e:
        kvkit.patch(model, "tidal" if "shadowkv" not in why else "shadowkv", budget=8)
    assert why in str(e.value)
    kvkit.unpatch(model)


def test_calibrated_layers_beyond_the_model_are_refused(caldir):
    model = tiny_model("llama", num_hidden_layers=6)
    _write(caldir / "tiny.json", model, {"tidal": _section(select_layers=[2, 9])})
    with pytest.raises(ValueError, match="select_layers must be < 6"):
        kvkit.patch(model, "tidal", budget=8)
    kvkit.unpatch(model)


def test_calibrate_shadowkv_cli_on_tiny_model(caldir, monkeypatch):
    import kvkit.models
    from kvkit.calibrate.cli import main_calibrate

    model = tiny_model("llama", num_hidden_layers=4)
    monkeypatch.setattr(kvkit.models, "load", lambda name, device="cpu": (model, WordTokenizer()))
    assert main_calibrate(["shadowkv", "--model", "my-model", "--length", "96", "--samples", "2",
                           "--max-error", "0.5"]) == 0
    path = caldir / "my-model.json"  # default --out: the first $KVKIT_CALIBRATION_DIR folder, found from there
    data = json.loads(path.read_text())
    sec = data["policies"]["shadowkv"]
    assert sec["command"].startswith("kvkit calibrate shadowkv") and sec["date"]
    rank = sec["options"]["rank"]
    assert 1 <= rank <= 32 and rank % 8 == 0
    ev = sec["evidence"]["key_error_per_rank"]
    assert ev["32"]["max_layer_error"] < 1e-3  # full width: exact
    assert store.lookup(model.config, "shadowkv") == ({"rank": rank}, path)
    kvkit.patch(model, "shadowkv", budget=16, min_prompt=16)
    assert {layer.rank for layer in kvkit.KVCache(model).layers} == {rank}
    kvkit.unpatch(model)


def test_key_rank_errors():
    from kvkit.calibrate.knobs import key_rank_errors

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=g) @ torch.randn(4, 12, generator=g)  # rank 4
    e = key_rank_errors(x)
    assert e.shape == (13,) and abs(float(e[0]) - 1) < 1e-6 and float(e[4]) < 1e-5 and bool((e[:-1] >= e[1:] - 1e-6).all())


def test_candidates():
    from kvkit.calibrate.knobs import ZIPCACHE_CANDIDATES, tidal_candidates, zipcache_bits

    c = tidal_candidates(30)
    assert (2, 12) in c and (2, 15) in c and all(x[0] == 2 and list(x) == sorted(set(x)) for x in c)
    assert zipcache_bits(ZIPCACHE_CANDIDATES[0]) == pytest.approx(6.4)
    assert zipcache_bits(dict(high_ratio=0.6, high_bits=4, low_bits=2, key_bits=4)) == pytest.approx(7.2)


@pytest.mark.parametrize("layout", [(2, 4), (2, 3, 6), (3, 6)])
def test_tidal_budget_for_matches_measured_reads(layout):
    """The read-fraction calibration's budget arithmetic is what a decode step really reads (decode_read_bytes)."""
    from kvkit.calibrate.knobs import tidal_budget_for, tidal_read_fraction
    from kvkit.policies.tidal import decode_read_bytes

    model = tiny_model("llama", num_hidden_layers=8)
    n = 96
    b = tidal_budget_for(layout, 8, n + 1, 0.7)  # the decode step holds n + 1 tokens
    assert b is not None and b < n
    assert tidal_read_fraction(layout, 8, n + 1, b) <= 0.7 < tidal_read_fraction(layout, 8, n + 1, b + 8)
    kvkit.patch(model, "tidal", budget=b, selection="kv_head", select_layers=layout)
    try:
        cache = kvkit.KVCache(model)
        ids = _ids(n)
        with torch.no_grad():
            out = model(ids, past_key_values=cache, use_cache=True)
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        r = decode_read_bytes(cache)
        assert r["read"] / r["full"] == pytest.approx(tidal_read_fraction(layout, 8, n + 1, b), abs=1e-9)
    finally:
        kvkit.unpatch(model)
    assert tidal_budget_for((2, 3, 4, 5, 6), 8, 100, 0.5) is None  # 7 full-read layers of 8 exceed half


def test_calibrate_tidal_at_a_read_fraction(monkeypatch):
    """Each layout gets the budget that puts its reads at the fraction; most needles wins, ties -> fewer layers."""
    from kvkit.calibrate import knobs, needles

    seen = []

    def fake_score(model, tok, data, specs, log=print, margin=False):
        seen.extend(specs)
        assert margin
        good = {"2,4,6": [1, 1, 0], "2,5": [1, 1, 0], "2,6": [1, 1, 0]}
        lp = {"2,4,6": [-0.5, -0.5, -3.0], "2,5": [-1.0, -1.0, -3.0], "2,6": [-1.0, -1.0, -3.0]}
        return {"full": [1, 1, 1], "predictions": {}, **{s[0]: good.get(s[0], [1, 0, 0]) for s in specs},
                "logprob": {"full": [-0.1] * 3, **{s[0]: lp.get(s[0], [-5.0] * 3) for s in specs}}}

    monkeypatch.setattr(needles, "score_policies", fake_score)
    monkeypatch.setattr(needles, "make_samples", lambda tok, n, length, seed=0: [None] * 3)
    model = tiny_model("llama", num_hidden_layers=8)
    opts, ev = knobs.calibrate_tidal(model, None, length=512, samples=3, read_fraction=0.7, log=lambda m: None)
    # three layouts answer 2 of 3; (2, 4, 6) keeps the answers likelier; (2, 5) and (2, 6) tie -> the earlier
    assert opts == {"select_layers": [2, 4, 6]} and ev["per_layout"]["2,4,6"]["answer_logprob"] == pytest.approx(-4 / 3, abs=1e-4)
    for label, _, o in seen:
        assert o["budget"] == knobs.tidal_budget_for(o["select_layers"], 8, 512, 0.7)
        assert ev["per_layout"][label]["read_fraction"] <= 0.7
    budgets = {lab: o["budget"] for lab, _, o in seen}
    assert budgets["2,4,6"] < budgets["2,5"]  # more selection layers, smaller budget
    with pytest.raises(ValueError, match="not both"):
        knobs.calibrate_tidal(model, None, length=512, samples=3, read_fraction=0.5, budget_fraction=0.25)


class CharTokenizer:
    """A character tokenizer for the tiny models (vocab 128), called like a HF tokenizer."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 120 for c in text]}


def test_answer_logprob_is_the_teacher_forced_likelihood():
    """With the full cache, the margin equals the answer tokens' log-probability from one plain forward over
    context + question + answer; a policy that evicts the context changes it."""
    from kvkit.calibrate.needles import NeedleSample, answer_logprob
    from kvkit.evals.common import encode
    from kvkit.evals.shared_prefill import record_prefill

    model = tiny_model("llama", num_hidden_layers=4)
    tok = CharTokenizer()
    ctx = "the code of the amber vault is 4711 . " * 6
    prompt = ctx + "\n\nwhat is the code? The code is"
    s = NeedleSample("n/0", prompt, len(ctx), "4711", 0.5, 1)
    ids = encode(tok, prompt + " " + s.answer)
    n_ans = len(" 4711")
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, -n_ans - 1:-1].float(), -1)
    want = float(lp.gather(-1, ids[0, -n_ans:, None]).mean())
    kvkit.patch(model, "full")
    try:
        rec = record_prefill(model, encode(tok, ctx))
        assert answer_logprob(model, tok, s, rec) == pytest.approx(want, abs=1e-4)
        kvkit.patch(model, "streaming", budget=8, sink=2)
        assert abs(answer_logprob(model, tok, s, rec) - want) > 1e-3
    finally:
        kvkit.unpatch(model)
