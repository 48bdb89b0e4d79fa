"""Defaults that keep the answer, ``preset="paper"``, the one-time fallback warning, ``kvkit.registry.describe`` and
``kvkit.patched``."""

import warnings

import pytest
import torch
from transformers import AutoConfig

import kvkit
from kvkit.policies import knobs
from kvkit.policies.protect_heads import DEFAULT_PROTECT, EVICTED_SHARE, default_protect
from kvkit.registry import describe, policy_class
from kvkit.testing import greedy, random_ids, tiny_config, tiny_model

EVICTING = ("snapkv", "cake", "kvzip", "chelsea")


def smollm2_config():
    """The bundled model's config shape (its DuoAttention pattern ships with kvkit), without loading weights."""
    return AutoConfig.for_model("llama", num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9,
                                hidden_size=576, vocab_size=49152, head_dim=64, intermediate_size=1536)


@pytest.mark.parametrize("policy", EVICTING)
def test_retrieval_heads_are_protected_by_default_where_a_pattern_ships(policy):
    mask = kvkit.get_policy(policy).protection(smollm2_config())
    assert mask is not None and int(mask.sum()) == round(DEFAULT_PROTECT * 90)


@pytest.mark.parametrize("policy", [p for p in EVICTING if p != "cake"])
@pytest.mark.parametrize("r, heads", [(0.25, 63), (0.5, 36), (0.75, 9), (0.9, 0)])
def test_the_default_protected_share_follows_the_compression_ratio(policy, r, heads):
    """With compression_ratio r the default protects the share f with f + (1 - f) / 6 = 1 - r (of the bundled
    model's 90 KV heads: 0.7 -> 63, 0.4 -> 36, 0.1 -> 9, none from r = 5/6 on), so the evicting heads keep a
    sixth of the context whatever the ratio."""
    mask = kvkit.get_policy(policy, compression_ratio=r).protection(smollm2_config())
    assert (0 if mask is None else int(mask.sum())) == heads
    f = default_protect(r)
    assert f == pytest.approx(heads / 90) and (f == 0 or f + (1 - f) * EVICTED_SHARE == pytest.approx(1 - r))


@pytest.mark.parametrize("r, heads", [(0.25, 63), (0.4, 41), (0.5, 27), (0.6, 20), (0.75, 9), (0.8, 4), (0.9, 0)])
def test_cake_protects_its_measured_share_between_its_knots_and_the_rule_outside(r, heads):
    """CAKE's default share is 0.3 at r = 0.5 (0.7 and 0.1 at 0.25 and 0.75, the rule's values there), linear
    between those knots (0.4 -> 0.46, 41 of 90 heads; 0.6 -> 0.22, 20), and the sixth-of-the-context rule beyond
    them (0.8 -> 0.04, 4; none from 5/6); a ratio the knots cover never falls back to the rule."""
    mask = kvkit.get_policy("cake", compression_ratio=r).protection(smollm2_config())
    assert (0 if mask is None else int(mask.sum())) == heads
    knots = policy_class("cake").protect_knots
    assert default_protect(0.5, knots) == pytest.approx(0.3) and default_protect(0.5) == pytest.approx(0.4)
    assert default_protect(0.8, knots) == default_protect(0.8) and default_protect(None, knots) == DEFAULT_PROTECT
    assert default_protect(0.5, ((0.5, 0.25),)) == 0.25  # a single knot holds on its own ratio only
    assert default_protect(0.6, ((0.5, 0.25),)) == default_protect(0.6)


def test_the_default_protected_share_reaches_every_ratio_the_policy_does():
    """No ratio is refused because of the default protection: it shrinks to none as the ratio grows."""
    for r in (0.8, 5 / 6, 0.95):
        assert kvkit.get_policy("snapkv", compression_ratio=r).validate(smollm2_config()) is None
    assert default_protect(None) == DEFAULT_PROTECT


@pytest.mark.parametrize("policy", EVICTING)
def test_the_paper_preset_evicts_in_every_head(policy):
    p = kvkit.get_policy(policy, preset="paper")
    assert p.protect_heads == 0.0 and p.protection(smollm2_config()) is None


@pytest.mark.parametrize("policy", EVICTING)
def test_no_shipped_pattern_warns_once_and_falls_back_to_every_head_evicted(policy, monkeypatch):
    monkeypatch.setattr(knobs, "_WARNED", set())
    cfg = tiny_config("llama")
    with pytest.warns(UserWarning, match=f"{policy}: no DuoAttention head pattern ships.*kvkit calibrate duo"):
        assert kvkit.get_policy(policy).protection(cfg) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second cache of the same model: no second warning
        assert kvkit.get_policy(policy).protection(cfg) is None


def test_the_paper_preset_restores_the_papers_settings_and_options_set_away_from_the_defaults_win():
    snap = kvkit.get_policy("snapkv", preset="paper")
    assert (snap.calibrated, snap.protect_heads) == (False, 0.0)
    assert kvkit.get_policy("snapkv", preset="paper", protect_heads=0.1).protect_heads == 0.1
    zc = kvkit.get_policy("zipcache", preset="paper")
    assert (zc.key_group, zc.stats, zc.calibrated) == (None, "auto", False)
    kz = kvkit.get_policy("kvzip", preset="paper")
    assert (kz.instruct, kz.normalize, kz.protect_heads) == (True, "chunk", 0.0)
    assert kvkit.get_policy("tidal", preset="paper").selection == "q_head"
    for name in kvkit.available_policies():  # every paper setting is one of the policy's options
        assert set(policy_class(name).paper) <= set(kvkit.policy_options(name))


def test_an_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="preset must be one of kvkit, paper"):
        kvkit.get_policy("cake", preset="fast")


@pytest.mark.parametrize("policy", kvkit.available_policies())
def test_describe_gives_every_option_a_meaning_a_default_and_a_reason(policy):
    rows = describe(policy)
    assert [r["name"] for r in rows] == list(kvkit.policy_options(policy))
    for r in rows:
        assert r["meaning"] and r["why"], f"{policy}.{r['name']}: {r}"
        assert r["default"] == kvkit.policy_options(policy)[r["name"]]


def test_patched_restores_the_model_when_the_body_raises():
    model = tiny_model("llama")
    ids = random_ids(20, seed=5)
    ref, _, _ = greedy(model, ids, 4)
    impl = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with kvkit.patched(model, "streaming", budget=8, sink=2, tail=2) as m:
            assert kvkit.patched_policy(m).name == "streaming"
            raise RuntimeError("boom")
    assert kvkit.patched_policy(model) is None and model.config._attn_implementation == impl
    toks, _, _ = greedy(model, ids, 4)
    assert torch.equal(toks, ref)


def test_patched_reinstalls_the_previous_patch_on_exit():
    model = tiny_model("llama")
    kvkit.patch(model, "streaming", budget=16, sink=2, tail=4)
    try:
        with kvkit.patched(model, "snapkv", budget=16, window=4, kernel=3, tail=4, protect_heads=0):
            assert kvkit.patched_policy(model).name == "snapkv"
        assert kvkit.patched_policy(model) == kvkit.get_policy("streaming", budget=16, sink=2, tail=4)
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("policy", ["snapkv", "cake", "kvzip", "chelsea"])
def test_a_runs_record_names_the_shipped_pattern_its_default_protection_reads(policy):
    """With ``protect_heads`` left at its default the shipped DuoAttention pattern ranks the protected heads, so an
    evaluation's record (``file_hashes``, what ``--resume`` compares) names that file's sha256; the paper's eviction
    reads no pattern and names none."""
    from kvkit.evals.settings import file_hashes

    cfg = smollm2_config()
    assert set(file_hashes(kvkit.get_policy(policy), cfg)) == {"protect_pattern"}
    assert file_hashes(kvkit.get_policy(policy, protect_heads=0), cfg) == {}
    assert file_hashes(kvkit.get_policy(policy, preset="paper"), cfg) == {}
