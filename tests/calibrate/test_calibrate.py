"""Per-model calibration files (kvkit.calibration) and the calibrators (kvkit.calibrate.<policy>, registry)."""

from __future__ import annotations

import json

import pytest
import torch

import kvkit
from kvkit import calibration as store
from kvkit.testing import calibration_file, greedy, tiny_model


class WordTokenizer:
    """Deterministic toy tokenizer for the tiny models (vocab 128): one id per word."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [2 + sum(map(ord, w)) % 126 for w in text.split()] or [2]


def _section(**options):
    return {"options": options, "command": "test", "date": "2026-11-23"}


def _refused(caldir, model, policy, options, cases):
    """Each (section options, message) written as ``policy``'s calibration is refused when the model is patched."""
    for bad, why in cases:
        calibration_file(caldir / "tiny.json", model.config, {policy: _section(**bad)})
        store._CACHE.clear()
        with pytest.raises(store.CalibrationError, match=why):
            kvkit.patch(model, policy, **options)
            kvkit.KVCache(model)
        kvkit.unpatch(model)


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
    calibration_file(caldir / "tiny.json", model.config, {"tidal": _section(select_layers=[1, 4]), "shadowkv": _section(rank=24),
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
    calibration_file(caldir / "tiny.json", model.config, {"cake": _section(tau1=2.0, tau2=0.5)})
    cake = kvkit.registry.policy_class("cake")
    assert store.resolve(cake(budget=16, window=4), model.config).taus(model.config) == (2.0, 0.5)
    assert store.resolve(cake(budget=16, window=4, calibrated=False), model.config).taus(model.config) == (1.0, 1.0)
    assert store.resolve(cake(budget=16, window=4, tau1=3.0), model.config).taus(model.config) == (3.0, 1.0)
    calibration_file(caldir / "tiny.json", model.config, {"cake": _section(tau1=2.0, tau2=0.5, pool_kernel=9)})
    store._CACHE.clear()
    kvkit.patch(model, "cake", budget=16, window=4)
    assert {st.kernel for st in kvkit.KVCache(model).layers if isinstance(st, CakeStore)} == {9}
    kvkit.patch(model, "cake", budget=16, window=4, calibrated=False)
    assert {st.kernel for st in kvkit.KVCache(model).layers if isinstance(st, CakeStore)} == {5}
    kvkit.unpatch(model)
    calibration_file(caldir / "tiny.json", model.config, {"cake": _section(tau1=2.0, tau2=0.5)})
    store._CACHE.clear()
    kvkit.patch(model, "cake", budget=16, window=4)
    stores = [layer for layer in kvkit.KVCache(model).layers if isinstance(layer, CakeStore)]
    assert stores and {(st.tau1, st.tau2) for st in stores} == {(2.0, 0.5)}
    greedy(model, _ids(40), 3)
    kvkit.unpatch(model)
    calibration_file(caldir / "tiny.json", model.config, {"cake": _section(tau1=-1.0, tau2=0.5)})
    store._CACHE.clear()
    with pytest.raises(ValueError, match="tau1"):
        kvkit.patch(model, "cake", budget=16, window=4)
        kvkit.KVCache(model)
    kvkit.unpatch(model)


def test_calibrate_cake_sweeps_the_taus(monkeypatch):
    """The sweep tries the paper's taus first and keeps the pair answering most needles (ties: the paper's)."""
    from kvkit.calibrate import cake as cal
    from kvkit.calibrate import needles

    seen = []

    def fake_score(model, tok, data, specs, log=print):
        seen.extend(specs)
        answered = {"2.0,0.5": [1, 1, 0], "0.5,0.5": [1, 1, 0]}
        return {"full": [1, 1, 1], "predictions": {}, **{s[0]: answered.get(s[0], [1, 0, 0]) for s in specs}}

    monkeypatch.setattr(needles, "score_policies", fake_score)
    monkeypatch.setattr(needles, "make_samples", lambda tok, n, length, seed=0, values="mixed": [None] * 3)
    model = tiny_model("llama", num_hidden_layers=4)
    opts, ev = cal.calibrate_cake(model, None, length=256, samples=3, budget_fraction=0.5, kernels=(),
                                  log=lambda m: None)
    assert seen[0][0] == "1.0,1.0" and all(sp[2]["budget"] == 128 for sp in seen)
    assert opts == {"tau1": 0.5, "tau2": 0.5}  # first of the two best in candidate order
    assert ev["per_taus"]["2.0,0.5"] == {"answered": 2, "of": 3} and ev["paper_taus"] == [1.0, 1.0]

    # with kernels: a second, question-aware stage at the chosen taus picks the pooling kernel
    def fake_pool(model, tok, specs, length, samples, seed=0, values="mixed", log=print):
        seen.extend(specs)
        return 2, {s[0]: {"answered": 1, "of": 1} for s in specs}, {"needles_answered_by_full": "1/1", "predictions": {}}

    monkeypatch.setattr(cal, "pooling_sweep", fake_pool)
    seen.clear()
    opts, ev = cal.calibrate_cake(model, None, length=256, samples=3, kernels=(5, 15, 31), log=lambda m: None)
    stage2 = [sp for sp in seen if "pool_kernel" in sp[2]]
    assert [sp[2]["pool_kernel"] for sp in stage2] == [5, 15, 31]
    assert all((sp[2]["tau1"], sp[2]["tau2"], sp[2]["budget"]) == (0.5, 0.5, 128) for sp in stage2)
    assert opts == {"tau1": 0.5, "tau2": 0.5, "pool_kernel": 31} and ev["pooling"]["paper_kernel"] == 5
    assert ev["pooling"]["needles_answered_by_full"] == "1/1"  # the sweep's shared evidence fields are kept
    # a trailing-window candidate (kvkit's) is a (kernel, "trailing") entry; when it wins, the file records it
    seen.clear()
    opts, ev = cal.calibrate_cake(model, None, length=256, samples=3, kernels=(5, 15, (31, "trailing")),
                                  log=lambda m: None)
    stage2 = [sp for sp in seen if "pool_kernel" in sp[2]]
    assert stage2[-1][0] == "kernel 31 trailing" and stage2[-1][2]["pool_window"] == "trailing"
    assert "pool_window" not in stage2[0][2]
    assert opts == {"tau1": 0.5, "tau2": 0.5, "pool_kernel": 31, "pool_window": "trailing"}


def test_calibrated_snapkv_pooling_found_from_config(caldir):
    """SnapKV's kernel / pooling: the calibration when both are left at None; the paper's (5, avg) one option away."""
    from kvkit.policies.snapkv import SnapKVStore

    model = tiny_model("llama", num_hidden_layers=4)
    calibration_file(caldir / "tiny.json", model.config, {"snapkv": _section(kernel=9, pooling="max")})
    snap = kvkit.registry.policy_class("snapkv")
    cfg = model.config
    assert snap(budget=16, window=4).settings(cfg) == (9, "max", "centered")
    assert snap(budget=16, window=4, calibrated=False).settings(cfg) == (5, "avg", "centered")
    assert snap(budget=16, window=4, kernel=3).settings(cfg) == (3, "avg", "centered")  # never mixed
    kvkit.patch(model, "snapkv", budget=16, window=4)
    stores = [layer for layer in kvkit.KVCache(model).layers if isinstance(layer, SnapKVStore)]
    assert stores and {(st.kernel, st.pooling) for st in stores} == {(9, "max")}
    greedy(model, _ids(40), 3)
    kvkit.unpatch(model)
    # a calibrated trailing window (kvkit's) reaches the stores; the user's pool_window alone disables the file
    calibration_file(caldir / "tiny.json", model.config, {"snapkv": _section(kernel=31, pooling="avg", pool_window="trailing")})
    store._CACHE.clear()
    assert snap(budget=16, window=4).settings(cfg) == (31, "avg", "trailing")
    assert snap(budget=16, window=4, pool_window="centered").settings(cfg) == (5, "avg", "centered")
    kvkit.patch(model, "snapkv", budget=16, window=4)
    stores = [layer for layer in kvkit.KVCache(model).layers if isinstance(layer, SnapKVStore)]
    assert {st.pool_window for st in stores} == {"trailing"}
    kvkit.unpatch(model)
    _refused(caldir, model, "snapkv", dict(budget=16, window=4), [
        (dict(kernel=31, pool_window="sideways"), "pool_window must be one of"),
        (dict(kernel=9, pooling="median"), "pooling must be 'avg' or 'max'")])


def test_calibrate_snapkv_sweeps_pooling_question_aware(monkeypatch):
    """The sweep scores with the question in the prefill, keeps the pooling answering most needles, breaks ties
    by the answers' log-probability, then the candidate order (the paper's first)."""
    from kvkit.calibrate import needles
    from kvkit.calibrate import snapkv as cal

    seen = {}

    def fake_score(model, tok, data, specs, log=print, margin=False, question_aware=False):
        seen.update(specs=specs, margin=margin, question_aware=question_aware)
        answered = {"15,avg": [1, 1, 0], "31,avg": [1, 1, 0], "9,max": [1, 1, 0]}
        lp = {"15,avg": [-0.5, -0.7], "31,avg": [-0.2, -0.4], "9,max": [-0.2, -0.4]}
        return {"full": [1, 1, 1], "predictions": {}, **{s[0]: answered.get(s[0], [1, 0, 0]) for s in specs},
                "logprob": {"full": [-0.1] * 3, **{s[0]: lp.get(s[0], [-1.0]) for s in specs}}}

    def fake_samples(tok, n, length, seed=0, far=False, values="mixed"):
        seen["far"], seen["values"] = far, values
        return [None] * 3

    monkeypatch.setattr(needles, "score_policies", fake_score)
    monkeypatch.setattr(needles, "make_samples", fake_samples)
    opts, ev = cal.calibrate_snapkv(tiny_model("llama", num_hidden_layers=4), None, length=256, samples=3,
                                    log=lambda m: None)
    assert seen["question_aware"] and seen["margin"] and seen["far"]
    assert seen["specs"][0][0] == "5,avg" and all(sp[2]["budget"] == 128 for sp in seen["specs"])
    assert opts == {"kernel": 31, "pooling": "avg"}  # 31,avg and 9,max tie on needles and log-prob: order
    assert ev["per_pooling"]["15,avg"] == {"answered": 2, "of": 3, "answer_logprob": -0.6}
    labels = [sp[0] for sp in seen["specs"]]
    assert "61,avg,trailing" in labels and seen["specs"][labels.index("61,avg,trailing")][2]["pool_window"] == "trailing"
    # the trailing window wins when it answers more: the options record pool_window
    def fake_trailing_wins(model, tok, data, specs, log=print, margin=False, question_aware=False):
        return {"full": [1, 1, 1], "predictions": {},
                **{s[0]: ([1, 1, 1] if s[0] == "15,avg,trailing" else [1, 0, 0]) for s in specs}}

    monkeypatch.setattr(needles, "score_policies", fake_trailing_wins)
    opts, _ = cal.calibrate_snapkv(tiny_model("llama", num_hidden_layers=4), None, length=256, samples=3,
                                   candidates=((5, "avg"), (31, "avg"), (15, "avg", "trailing")), log=lambda m: None)
    assert opts == {"kernel": 15, "pooling": "avg", "pool_window": "trailing"}
    with pytest.raises(ValueError, match="budget_fraction"):
        cal.calibrate_snapkv(None, None, budget_fraction=1.5)


def test_calibrated_chelsea_protection_found_from_config(caldir):
    """Chelsea's chunk size and protection score: the calibration when protect > 0 (the default protects 0.8 x ratio)
    and none of them is given; the paper's matching (protect 0) and calibrated=False (which also makes the default
    protect 0) take kvkit's fallbacks (64-token chunks, kernel 7 max centered); a malformed section is refused when
    the model is patched."""
    from kvkit.policies.chelsea import ChelseaStore

    model = tiny_model("llama", num_hidden_layers=4)
    calibration_file(caldir / "tiny.json", model.config, {"chelsea": _section(chunk_size=16, protect_kernel=5, protect_pooling="avg",
                                                              protect_window="trailing")})
    chel = kvkit.registry.policy_class("chelsea")
    cfg = model.config

    def got(**kw):
        p = chel(**kw).settings(cfg)
        return p.chunk_size, p.protect_kernel, p.protect_pooling, p.protect_window

    assert got(ratio=0.5, protect=0.25) == (16, 5, "avg", "trailing")
    assert got(ratio=0.5) == (16, 5, "avg", "trailing")  # the default protects: calibrated
    # with the calibrated 16-token chunk the default protects ceil(0.8 * 0.5 * 16) = 7 of the 8 kept slots
    assert chel(ratio=0.5).settings(cfg).protected_per_chunk == 7
    assert got(ratio=0.5, protect=0) == (64, 7, "max", "centered")  # the paper's matching: no protection to calibrate
    assert got(ratio=0.5, calibrated=False) == (64, 7, "max", "centered")
    assert chel(ratio=0.5, calibrated=False).settings(cfg).protected_per_chunk == 0  # the paper's whole setting
    assert got(ratio=0.5, protect=0.25, calibrated=False) == (64, 7, "max", "centered")
    assert got(ratio=0.5, protect=0.25, chunk_size=32) == (32, 7, "max", "centered")  # never mixed
    kvkit.patch(model, "chelsea", ratio=0.5, protect=0.25, window=4, sink=2)
    stores = [layer for layer in kvkit.KVCache(model).layers if isinstance(layer, ChelseaStore)]
    assert stores and {(st.p.chunk_size, st.p.protect_kernel, st.p.protect_window) for st in stores} == {
        (16, 5, "trailing")}
    greedy(model, _ids(60), 3)
    kvkit.unpatch(model)
    from kvkit.evals.settings import calibration_used

    assert calibration_used(model, "chelsea", {"ratio": 0.5, "protect": 0}) is None
    assert calibration_used(model, "chelsea", {"ratio": 0.5})["options"]["chunk_size"] == 16
    assert calibration_used(model, "chelsea", {"ratio": 0.5, "protect": 0.25})["options"]["chunk_size"] == 16
    _refused(caldir, model, "chelsea", dict(ratio=0.5, protect=0.25), [
        (dict(chunk_size=16, protect_window="sideways"), "protect_window must be one of"),
        (dict(protect_kernel=4), "protect_kernel must be a positive odd integer"),
        (dict(chunk_size=2), r"do not combine.*use protect < ratio"),
        (dict(ratio=0.5), "may set only")])


def test_chelsea_protect_is_checked_against_the_calibrated_chunk(caldir):
    """protect < ratio is checked on the chunk in effect: 0.49 fits a calibrated 128-token chunk (63 of its 64 kept
    slots), not the 64-token fallback (32 of 32), so it is refused only where the fallback applies (at patch time)."""
    model = tiny_model("llama", num_hidden_layers=4)
    calibration_file(caldir / "tiny.json", model.config, {"chelsea": _section(chunk_size=128, protect_kernel=5, protect_pooling="avg",
                                                              protect_window="trailing")})
    chel = kvkit.registry.policy_class("chelsea")
    p = chel(ratio=0.5, protect=0.49)  # the chunk is not known yet: not refused
    assert p.settings(model.config).protected_per_chunk == 63
    with pytest.raises(ValueError, match="keeps 32 of each 64-token chunk exact.*use protect < ratio"):
        chel(ratio=0.5, protect=0.49, calibrated=False).settings(model.config)
    with pytest.raises(ValueError, match="use protect < ratio"):
        kvkit.patch(model, "chelsea", ratio=0.5, protect=0.49, calibrated=False)
    with pytest.raises(ValueError, match="use protect < ratio"):
        chel(ratio=0.5, protect=0.49, chunk_size=64)  # a given chunk is checked at once


def test_calibrate_chelsea_sweeps_the_protection_question_aware(monkeypatch):
    """The sweep runs Chelsea at ratio = budget_fraction with protect 0.8 x ratio, the question in the prefill, and
    records the winner's chunk size and protection pooling (ties: log-probability, then kvkit's fallback first)."""
    from kvkit.calibrate import chelsea as cal
    from kvkit.calibrate import needles

    seen = {}

    def fake_score(model, tok, data, specs, log=print, margin=False, question_aware=False):
        seen.update(specs=specs, question_aware=question_aware)
        win = "chunk 128, 31,max,trailing"
        return {"full": [1, 1, 1], "predictions": {}, **{s[0]: ([1, 1, 1] if s[0] == win else [1, 0, 0]) for s in specs},
                "logprob": {"full": [-0.1] * 3, **{s[0]: [-1.0] for s in specs}}}

    monkeypatch.setattr(needles, "score_policies", fake_score)
    monkeypatch.setattr(needles, "make_samples", lambda tok, n, length, seed=0, far=False, values="mixed": [None] * 3)
    opts, ev = cal.calibrate_chelsea(tiny_model("llama", num_hidden_layers=4), None, length=256, samples=3,
                                     log=lambda m: None)
    assert seen["question_aware"]
    assert seen["specs"][0][0] == "chunk 64, 7,max" and all(
        sp[2]["ratio"] == 0.5 and sp[2]["protect"] == 0.4 for sp in seen["specs"])
    assert opts == {"chunk_size": 128, "protect_kernel": 31, "protect_pooling": "max", "protect_window": "trailing"}
    assert ev["per_setting"]["chunk 128, 31,max,trailing"]["answered"] == 3
    kvkit.registry.policy_class("chelsea")(ratio=0.5, protect=0.4, **opts)  # the options it records are valid
    with pytest.raises(ValueError, match="budget_fraction"):
        cal.calibrate_chelsea(None, None, budget_fraction=0)


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
        calibration_file(path, model.config, {"tidal": _section(budget=16)})
    elif "refused by the policy" in why:
        calibration_file(path, model.config, {"tidal": _section(select_layers=[4, 2])})
    else:
        calibration_file(path, model.config, {"shadowkv": {"options": {}}})
    with pytest.raises(ValueError, match="calibration file .*bad.json.* is malformed") as e:
        kvkit.patch(model, "tidal" if "shadowkv" not in why else "shadowkv", budget=8)
    assert why in str(e.value)
    kvkit.unpatch(model)


def test_calibrated_layers_beyond_the_model_are_refused(caldir):
    model = tiny_model("llama", num_hidden_layers=6)
    calibration_file(caldir / "tiny.json", model.config, {"tidal": _section(select_layers=[2, 9])})
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
    from kvkit.calibrate.shadowkv import key_rank_errors

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=g) @ torch.randn(4, 12, generator=g)  # rank 4
    e = key_rank_errors(x)
    assert e.shape == (13,) and abs(float(e[0]) - 1) < 1e-6 and float(e[4]) < 1e-5 and bool((e[:-1] >= e[1:] - 1e-6).all())


def test_candidates():
    from kvkit.calibrate.tidal import tidal_candidates
    from kvkit.calibrate.zipcache import ZIPCACHE_CANDIDATES, zipcache_bits

    c = tidal_candidates(30)
    assert (2, 12) in c and (2, 15) in c and all(x[0] == 2 and list(x) == sorted(set(x)) for x in c)
    assert zipcache_bits(ZIPCACHE_CANDIDATES[0]) == pytest.approx(6.4)
    assert zipcache_bits(dict(high_ratio=0.6, high_bits=4, low_bits=2, key_bits=4)) == pytest.approx(7.2)


@pytest.mark.parametrize("layout", [(2, 4), (2, 3, 6), (3, 6)])
def test_tidal_budget_for_matches_measured_reads(layout):
    """The read-fraction calibration's budget arithmetic is what a decode step really reads (decode_read_bytes)."""
    from kvkit.calibrate.tidal import tidal_budget_for, tidal_read_fraction
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
    from kvkit.calibrate import needles
    from kvkit.calibrate import tidal as cal

    seen = []

    def fake_score(model, tok, data, specs, log=print, margin=False):
        seen.extend(specs)
        assert margin
        good = {"2,4,6": [1, 1, 0], "2,5": [1, 1, 0], "2,6": [1, 1, 0]}
        lp = {"2,4,6": [-0.5, -0.5, -3.0], "2,5": [-1.0, -1.0, -3.0], "2,6": [-1.0, -1.0, -3.0]}
        return {"full": [1, 1, 1], "predictions": {}, **{s[0]: good.get(s[0], [1, 0, 0]) for s in specs},
                "logprob": {"full": [-0.1] * 3, **{s[0]: lp.get(s[0], [-5.0] * 3) for s in specs}}}

    monkeypatch.setattr(needles, "score_policies", fake_score)
    monkeypatch.setattr(needles, "make_samples", lambda tok, n, length, seed=0, values="mixed": [None] * 3)
    model = tiny_model("llama", num_hidden_layers=8)
    opts, ev = cal.calibrate_tidal(model, None, length=512, samples=3, read_fraction=0.7, log=lambda m: None,
                                   shares=False)
    # three layouts answer 2 of 3; (2, 4, 6) keeps the answers likelier; (2, 5) and (2, 6) tie -> the earlier
    assert opts == {"select_layers": [2, 4, 6]} and ev["per_layout"]["2,4,6"]["answer_logprob"] == pytest.approx(-4 / 3, abs=1e-4)
    for label, _, o in seen:
        assert o["budget"] == cal.tidal_budget_for(o["select_layers"], 8, 512, 0.7)
        assert ev["per_layout"][label]["read_fraction"] <= 0.7
    budgets = {lab: o["budget"] for lab, _, o in seen}
    assert budgets["2,4,6"] < budgets["2,5"]  # more selection layers, smaller budget
    with pytest.raises(ValueError, match="not both"):
        cal.calibrate_tidal(model, None, length=512, samples=3, read_fraction=0.5, budget_fraction=0.25)


class CharTokenizer:
    """A character tokenizer for the tiny models (vocab 128), called like a HF tokenizer."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 120 for c in text]}


def test_answer_logprob_is_the_teacher_forced_likelihood():
    """With the full cache, the margin equals the answer tokens' log-probability from one plain forward over
    context + question + answer; a policy that evicts the context changes it."""
    from kvkit.calibrate.needles import NeedleSample, answer_logprob
    from kvkit.evals.generation import encode
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
        assert answer_logprob(model, tok, s, None, question_aware=True) == pytest.approx(want, abs=1e-4)
        kvkit.patch(model, "streaming", budget=8, sink=2)
        assert abs(answer_logprob(model, tok, s, rec) - want) > 1e-3
        # question-aware: the whole prompt prefilled exactly, then compressed (SnapKV scores with the question)
        kvkit.patch(model, "snapkv", budget=12, window=4)
        qa = answer_logprob(model, tok, s, None, question_aware=True)
        assert abs(qa - want) > 1e-4 and abs(qa - answer_logprob(model, tok, s, rec)) > 1e-4
    finally:
        kvkit.unpatch(model)


def test_far_needles_put_the_value_a_dozen_words_after_its_key():
    from kvkit.calibrate import needles

    try:
        needles.essay_text()
    except Exception as e:  # the essay package is what CI installs; say so when it is missing
        pytest.skip(f"calibration essays not installed: {e}")
    tok = CharTokenizer()
    near = needles.make_samples(tok, 8, 600, seed=1)
    far = needles.make_samples(tok, 8, 600, seed=1, far=True)
    tail = " ".join(needles.NEEDLE_FAR.split()[-3:])  # "inner door is {value}."
    for i, (a, b) in enumerate(zip(near, far)):
        assert a.answer == b.answer and a.needles == b.needles
        assert f"vault is {a.answer}." in a.prompt and tail.format(value=a.answer) not in a.prompt
        if (i // 2) % 2 == 1:  # samples 2, 3, 6, 7: every needle in the far form, one 1-needle and one 3-needle
            assert tail.format(value=b.answer) in b.prompt and f"vault is {b.answer}." not in b.prompt[:b.context_end]
        else:
            assert b.prompt == a.prompt


def test_mixed_needles_hold_codes_in_half_the_samples():
    """values="mixed" (the default): samples 1, 2, 5, 6 hold UUID-shaped codes (asked with the code question, given
    room to be written out), the others the same 7-digit numbers as values="number"; any 4 consecutive samples
    cover 1 and 3 needles x number and code; an unknown kind is refused."""
    import re

    from kvkit.calibrate import needles

    try:
        needles.essay_text()
    except Exception as e:
        pytest.skip(f"calibration essays not installed: {e}")
    tok = CharTokenizer()
    mixed = needles.make_samples(tok, 8, 600, seed=3)
    number = needles.make_samples(tok, 8, 600, seed=3, values="number")
    uuid = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    kinds = set()
    for i, (m, n) in enumerate(zip(mixed, number)):
        assert n.answer.isdigit() and len(n.answer) == 7 and n.max_new_tokens == 12
        assert needles.QUESTION.format(key="x").split("?")[1] in n.prompt[n.context_end:]
        if i in (1, 2, 5, 6):
            assert uuid.match(m.answer) and m.max_new_tokens >= 40
            assert f"vault is {m.answer}." in m.prompt[: m.context_end]
            assert "Answer with the code only." in m.prompt[m.context_end:]
            # every needle of a code sample holds a code (the distractors too)
            assert len(re.findall(r"vault is [0-9a-f]{8}-", m.prompt[: m.context_end])) == m.needles
        else:
            assert m.answer.isdigit() and len(m.answer) == 7 and "number only" in m.prompt[m.context_end:]
        kinds.add((m.needles, m.answer.isdigit()))
    assert kinds == {(1, True), (1, False), (3, True), (3, False)}
    assert len({(m.needles, m.answer.isdigit()) for m in mixed[4:8]}) == 4
    with pytest.raises(ValueError, match="mixed, number"):
        needles.make_samples(tok, 2, 600, values="uuid")


def test_calibration_cli_passes_the_needle_values(monkeypatch, tmp_path):
    """``--values`` reaches every needle calibration (default mixed) and is recorded in the command."""
    import importlib

    from kvkit import calibration as store
    from kvkit.calibrate import cli

    got = {}

    def fake(name):
        def f(model, tok, **kw):
            got[name] = kw["values"]
            return {"x": 1}, {"seconds": 0.0}
        return f

    for name in ("tidal", "zipcache", "cake", "snapkv", "chelsea"):
        monkeypatch.setattr(importlib.import_module(f"kvkit.calibrate.{name}"), f"calibrate_{name}", fake(name))
    model = tiny_model("llama", num_hidden_layers=4)
    monkeypatch.setattr("kvkit.models.load", lambda name, device="cpu": (model, None))
    monkeypatch.setattr("kvkit.models.resolve_name", lambda name: "tiny")
    written = []
    monkeypatch.setattr(store, "write_section", lambda path, ident, knob, opts, command, ev: written.append(command) or path)
    for name in ("tidal", "zipcache", "cake", "snapkv", "chelsea"):
        cli.main_calibrate([name, "--out", str(tmp_path / "c.json")])
        assert got[name] == "mixed"
        cli.main_calibrate([name, "--out", str(tmp_path / "c.json"), "--values", "number"])
        assert got[name] == "number" and written[-1].endswith("--values number")
    with pytest.raises(SystemExit):
        cli.main_calibrate(["zipcache", "--values", "hex"])


def test_run_config_records_the_calibration_and_resume_refuses_another(caldir, tmp_path):
    """A run folder records the calibrated options its policy used; resuming it after a recalibration is refused
    (rows of two settings would mix), a folder made before the field existed still resumes."""
    from kvkit.evals.rundir import RunDir
    from kvkit.evals.settings import calibration_used

    model = tiny_model("llama", num_hidden_layers=4)
    calibration_file(caldir / "tiny.json", model.config, {"snapkv": _section(kernel=9, pooling="max")})
    used = calibration_used(model, "snapkv", {"budget": 16, "window": 4})
    assert used == {"options": {"kernel": 9, "pooling": "max"}, "file": "tiny.json"}
    assert calibration_used(model, "snapkv", {"budget": 16, "window": 4, "calibrated": False}) is None
    assert calibration_used(model, "snapkv", {"budget": 16, "window": 4, "kernel": 3}) is None
    assert calibration_used(model, "full", {}) is None
    cfg = {"benchmark": "ruler", "policy": "snapkv", "options": {"budget": 16}, "calibration": used}
    RunDir(tmp_path / "run", cfg)
    RunDir(tmp_path / "run", cfg, resume=True)  # same calibration: fine
    other = dict(cfg, calibration={"options": {"kernel": 61, "pooling": "avg"}, "file": "tiny.json"})
    with pytest.raises(ValueError, match="different configuration.*calibration"):
        RunDir(tmp_path / "run", other, resume=True)
    old = {k: v for k, v in cfg.items() if k != "calibration"}
    RunDir(tmp_path / "old", old)
    RunDir(tmp_path / "old", cfg, resume=True)  # made before the field was recorded


def test_bad_kernels_refused_before_the_model_loads(monkeypatch, capsys):
    """``kvkit calibrate cake --kernels`` with a malformed list stops with what to write, before minutes of loading."""
    from kvkit.calibrate import cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --kernels was checked")

    monkeypatch.setattr("kvkit.models.load", no_load)
    for bad, match in (("4", "positive odd"), ("5,x", "expected odd integers"), ("31q", "expected odd integers")):
        with pytest.raises(SystemExit) as e:  # the parser's refusal: exit 2, one error line naming the flag
            cli.main_calibrate(["cake", "--kernels", bad])
        assert e.value.code == 2 and match in capsys.readouterr().err


# ---- tidal layer shares ----------------------------------------------------------------------------------------
def test_tidal_shares_equalise_the_captured_mass():
    """Max-min water-filling: the layer whose reads capture less attention gets more of the budget, the reuse layers'
    mean share is 1 (so are the reads), other layers stay 1.0; equal curves give equal shares."""
    from kvkit.calibrate.tidal import tidal_shares_from_curves

    g = 8
    spread = [j / g for j in range(1, g + 1)]  # attention spread evenly: each step captures as much
    peaked = [min(1.0, 0.9 + 0.1 * j / g) for j in range(1, g + 1)]  # concentrated: the first step captures 0.91
    shares = tidal_shares_from_curves({3: spread, 5: peaked}, 6, 0.5, grid=g)
    assert shares[:3] == [1.0, 1.0, 1.0] and shares[4] == 1.0
    assert shares[3] > 1 > shares[5] and (shares[3] + shares[5]) / 2 == pytest.approx(1.0, abs=1e-3)
    assert shares[3] == pytest.approx(7 / 4) and shares[5] == pytest.approx(1 / 4)  # 7 of 8 steps to layer 3
    assert tidal_shares_from_curves({3: spread, 5: spread}, 6, 0.5, grid=g) == [1.0] * 6


def test_calibrate_tidal_shares_on_a_tiny_model(caldir):
    """Capture curves are cumulative attention mass (non-decreasing, 1 at the whole context), the shares keep the
    reuse layers' mean, and the calibrated layers + shares written to a file are what a patched model then uses."""
    from kvkit.calibrate import needles
    from kvkit.calibrate import tidal as cal
    from kvkit.calibrate.needles import NeedleSample

    model = tiny_model("llama", num_hidden_layers=8)
    tok = CharTokenizer()
    ctx = "the code of the amber vault is 4711 . and then some words of filler text follow here . " * 5
    data = [NeedleSample(f"n/{i}", ctx + "\n\nwhat is the code? The code is", len(ctx), "4711", 0.5, 1)
            for i in range(2)]
    for selection in ("shared", "kv_head"):  # tidal's two selections with one ranking per KV head
        curves = cal.tidal_capture_curves(model, tok, (2, 5), data, grid=16, selection=selection)
        assert sorted(curves) == [3, 4, 6, 7]  # the reuse layers
        for c in curves.values():
            assert len(c) == 16 and all(b >= a - 1e-9 for a, b in zip(c, c[1:]))
            assert c[-1] == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="--no-shares"):  # per-query-head lists: no per-layer read to size
        cal.calibrate_tidal(model, tok, length=64, samples=1, read_fraction=0.7, layout=(2, 5), selection="q_head")
    orig = needles.make_samples
    needles.make_samples = lambda tok, n, length, seed=0, values="mixed": data
    try:
        opts, ev = cal.calibrate_tidal(model, tok, length=len(ctx), samples=2, read_fraction=0.7,
                                       layout=(2, 5), log=lambda m: None)
    finally:
        needles.make_samples = orig
    sh = opts["layer_shares"]
    assert opts["select_layers"] == [2, 5] and len(sh) == 8
    assert sh[:3] == [1.0] * 3 and sh[5] == 1.0 and sum(sh[i] for i in (3, 4, 6, 7)) / 4 == pytest.approx(1.0, abs=1e-2)
    assert ev["layout"] == "given (not swept)" and min(ev["shares"]["captured_shared"].values()) >= min(
        ev["shares"]["captured_uniform"].values()) - 1e-9
    calibration_file(caldir / "tiny.json", model.config, {"tidal": _section(**opts)})
    pol = store.resolve(kvkit.registry.policy_class("tidal")(budget=8), model.config)
    assert pol.select_layers == (2, 5) and pol.layer_shares == tuple(sh)
    # the shares belong to the calibrated layers: a user's own layout takes none of them
    assert store.resolve(kvkit.registry.policy_class("tidal")(budget=8, select_layers=[2, 4]),
                         model.config).layer_shares is None
    kvkit.patch(model, "tidal", budget=8)
    try:
        cache = kvkit.KVCache(model)
        assert [layer.budget for layer in cache.layers] == pol.layer_budgets(8)
    finally:
        kvkit.unpatch(model)
    with pytest.raises(ValueError, match="only the layer shares"):
        cal.calibrate_tidal(model, tok, length=64, samples=1, read_fraction=0.7, layout=(2, 5), shares=False)


def test_malformed_tidal_shares_refused(caldir):
    model = tiny_model("llama", num_hidden_layers=6)
    calibration_file(caldir / "bad.json", model.config, {"tidal": _section(select_layers=[2, 4], layer_shares=[1, 1, 1, -2, 1, 1])})
    with pytest.raises(ValueError, match="bad.json.* is malformed.*layer_shares must be a list of positive numbers"):
        kvkit.patch(model, "tidal", budget=8)
    kvkit.unpatch(model)
    calibration_file(caldir / "bad.json", model.config, {"tidal": _section(select_layers=[2, 4], layer_shares=[1, 1, 1])})
    with pytest.raises(ValueError, match="one share per model layer"):
        kvkit.patch(model, "tidal", budget=8)
    kvkit.unpatch(model)


@pytest.mark.parametrize("bad", ["2,x", "6,2", "", "-1,3"])
def test_calibrate_tidal_select_layers_checked_before_loading(bad, monkeypatch, capsys):
    import kvkit.models
    from kvkit.calibrate import cli

    monkeypatch.setattr(kvkit.models, "load", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(SystemExit) as e:  # the parser's refusal: exit 2, one error line naming the flag
        cli.main_calibrate(["tidal", f"--select-layers={bad}"])
    assert e.value.code == 2 and "error: argument --select-layers: expected" in capsys.readouterr().err


# ---- the calibrator registry -----------------------------------------------------------------------------------
def test_each_calibrated_policy_has_its_calibrator_module():
    """One calibrator per calibrated policy, registered from ``kvkit/calibrate/<policy>.py``; the store's table is
    the policies' own ``calibrated_options``; the CLI offers one command per calibrator (and duo)."""
    import argparse

    from kvkit.calibrate import cli, duo_cli, parsers, registry

    cals = registry.calibrators()
    # the torch-free parser table: every calibrator, in the policy registry's order
    assert list(parsers.COMMANDS) == [name for name in kvkit.available_policies() if name in cals]
    assert all(cal.command is parsers.COMMANDS[name] for name, cal in cals.items())
    assert set(cals) == set(store.calibrated_options()) == {"shadowkv", "tidal", "zipcache", "cake", "snapkv",
                                                             "chelsea"}
    assert all(cal.run.__module__ == f"kvkit.calibrate.{name}" for name, cal in cals.items())
    assert store.CALIBRATED_OPTIONS == {  # what the files may set (the table store.py held before)
        "tidal": ("select_layers", "reselect_layer", "layer_shares"),
        "shadowkv": ("rank",),
        "zipcache": ("high_ratio", "high_bits", "low_bits", "key_bits"),
        "cake": ("tau1", "tau2", "pool_kernel", "pool_window"),
        "snapkv": ("kernel", "pooling", "pool_window"),
        "chelsea": ("chunk_size", "protect_kernel", "protect_pooling", "protect_window"),
    }
    p = argparse.ArgumentParser(prog="kvkit")
    cli.add_commands(p.add_subparsers(dest="command"))
    for name in ("duo", *cals):
        args = p.parse_args(["calibrate", name, *(["--out", "x.json"] if name == "duo" else [])])
        assert args.func is (duo_cli.cmd_calibrate_duo if name == "duo" else cli.cmd_calibrate_knob)
    for name, func in (("duo-merge", duo_cli.cmd_duo_merge), ("duo-refine", duo_cli.cmd_duo_refine)):
        assert p.parse_args(["calibrate", name, "a.json", "b.json", "--out", "m.json"]).func is func
    with pytest.raises(ValueError, match="no calibrator for policy 'full'"):
        registry.get("full")
    with pytest.raises(ValueError, match="declares no calibrated_options"):
        registry.calibrator("streaming", command=lambda sub: None)


def test_calibration_store_imports_no_calibrator_and_calibrate_no_evals_at_import():
    """The store (what the policies read at run time) imports neither a calibrator nor kvkit.evals, and no module of
    kvkit.calibrate imports kvkit.evals at module level (kvkit.evals reads the store): no import circle."""
    import ast
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(kvkit.__file__).parent / "calibrate"

    def imported(nodes):
        out = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                out.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
        return out

    tree = ast.parse((root.parent / "calibration.py").read_text())
    assert not [m for m in imported(ast.walk(tree)) if m.startswith(("kvkit.evals", "kvkit.calibrate"))]
    for f in root.glob("*.py"):
        top = imported(ast.parse(f.read_text()).body)
        assert not [m for m in top if m.startswith("kvkit.evals")], f
    code = "import kvkit.calibration, kvkit.calibrate.registry as r; r.calibrators()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_tidal_cli_with_given_layers_keeps_the_sweep_that_chose_them(caldir, monkeypatch):
    """``kvkit calibrate tidal --select-layers`` (shares only) keeps the replaced section's command and evidence as
    layout_command / layout_evidence when its layers are the same, and not when they differ."""
    from kvkit.calibrate import cli
    from kvkit.calibrate import tidal as cal

    model = tiny_model("llama", num_hidden_layers=6)
    monkeypatch.setattr("kvkit.models.load", lambda name, device="cpu": (model, None))
    monkeypatch.setattr("kvkit.models.resolve_name", lambda name: "tiny")
    monkeypatch.setattr(cal, "calibrate_tidal", lambda model, tok, **kw: (
        {"select_layers": list(kw["layout"]), "layer_shares": [1.0] * 6}, {"layout": "given (not swept)"}))
    path = caldir / "tiny.json"
    calibration_file(path, model.config, {"tidal": {**_section(select_layers=[2, 4]), "command": "kvkit calibrate tidal",
                                   "evidence": {"per_layout": {"2,4": {"answered": 3}}}}})
    store._CACHE.clear()
    assert cli.main_calibrate(["tidal", "--select-layers", "2,4", "--out", str(path)]) == 0
    ev = json.loads(path.read_text())["policies"]["tidal"]["evidence"]
    assert ev["layout_command"] == "kvkit calibrate tidal" and ev["layout_evidence"]["per_layout"]["2,4"]["answered"] == 3
    assert cli.main_calibrate(["tidal", "--select-layers", "2,4", "--out", str(path)]) == 0  # and again: still kept
    ev = json.loads(path.read_text())["policies"]["tidal"]["evidence"]
    assert ev["layout_command"] == "kvkit calibrate tidal" and "per_layout" in ev["layout_evidence"]
    assert cli.main_calibrate(["tidal", "--select-layers", "2,3", "--out", str(path)]) == 0
    assert "layout_command" not in json.loads(path.read_text())["policies"]["tidal"]["evidence"]
