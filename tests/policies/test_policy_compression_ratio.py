"""``compression_ratio``: every compressing policy maps it to its native knobs so that a decode step reads ``1 - r`` of
full's K/V bytes (``KVCache.read_nbytes``), refuses it beside a native knob it sets, and refuses a ratio it cannot
reach with the range it can (on a tiny random model: 12 layers so that TidalDecode has reuse layers, head_dim 64 as
the bundled model's)."""

import warnings

import pytest
import torch

import kvkit
from kvkit.testing import random_ids, tiny_config, tiny_model

POLICIES = [p for p in kvkit.available_policies() if p != "full"]
PROMPT = 512
#: options the tiny model needs: duo's pattern (one row per layer) and a streaming window below the prompt (ShadowKV
#: needs no threshold below the prompt: under compression_ratio it compresses prompts shorter than its paper's 4096)
EXTRA = dict(duo=dict(pattern=[[0.9, 0.2], [0.1, 0.7], [0.4, 0.6], [0.8, 0.3], [0.25, 0.35], [0.5, 0.45]] * 2,
                      sink=4, recent=28))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def bf16_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("llama", num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()


@torch.no_grad()
def read_bytes(model, policy, ids, **options) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no head pattern ships for a random model: protect_heads falls back to 0
        with kvkit.patched(model, policy, **options):
            cache = kvkit.KVCache(model)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            return int(cache.read_nbytes())


@pytest.mark.parametrize("policy", POLICIES)
def test_half_the_reads_at_compression_ratio_one_half(policy, model, bf16_model):
    # zipcache's widths (2 to 8 bits) reach r = 0.5 only on a 16-bit model
    m = bf16_model if policy == "zipcache" else model
    ids = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    full = read_bytes(m, "full", ids)
    got = read_bytes(m, policy, ids, compression_ratio=0.5, **EXTRA.get(policy, {})) / full
    assert abs(got - 0.5) <= 0.05 * 0.5, f"{policy}: read {got:.3f} of full's bytes at compression_ratio=0.5"


@pytest.mark.parametrize("policy", ["snapkv", "cake", "kvzip", "chelsea"])
def test_protected_heads_count_in_the_mapping(policy, model):
    """With a quarter of the KV heads kept whole (a pattern that leaves layers with 0, 1 or 2 evicted heads), the
    evicted heads' budget still makes the decode step read half of full's bytes."""
    ids = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    full = read_bytes(model, "full", ids)
    got = read_bytes(model, policy, ids, compression_ratio=0.5, protect_heads=0.25, protect_pattern=EXTRA["duo"]["pattern"])
    assert abs(got / full - 0.5) <= 0.05 * 0.5, f"{policy}: read {got / full:.3f} of full's bytes"


def test_the_budget_follows_the_prompt_length(model):
    """A token budget is resolved when the prompt arrives: twice the prompt, twice the slots kept."""
    kept = []
    for n in (256, 512):
        with kvkit.patched(model, "streaming", compression_ratio=0.5):
            cache = kvkit.KVCache(model)
            with torch.no_grad():
                model(input_ids=torch.randint(1, 128, (1, n)), past_key_values=cache, use_cache=True)
            kept.append(cache.layers[0].num_slots())
    assert kept[1] == pytest.approx(2 * kept[0], abs=2) and kept[0] == pytest.approx(128, abs=2)


@pytest.mark.parametrize("policy, native", [("streaming", dict(budget=256)), ("snapkv", dict(budget=512)),
                                            ("cake", dict(budget=512)), ("kvzip", dict(budget=512)),
                                            ("chelsea", dict(ratio=0.5)), ("duo", dict(sparsity=0.5)),
                                            ("tidal", dict(budget=64)), ("shadowkv", dict(budget=512)),
                                            ("zipcache", dict(high_bits=8))])
def test_a_native_knob_beside_compression_ratio_is_refused(policy, native):
    with pytest.raises(ValueError, match="compression_ratio.*not both"):
        kvkit.get_policy(policy, compression_ratio=0.5, **native)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.2, True, "half"])
def test_compression_ratio_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError, match="compression_ratio must be a fraction in \\(0, 1\\)"):
        kvkit.get_policy("snapkv", compression_ratio=bad)


def test_full_takes_no_compression_ratio():
    with pytest.raises(ValueError, match="full compresses nothing"):
        kvkit.get_policy("full", compression_ratio=0.5)


def test_unreachable_ratios_are_refused_with_the_reachable_range(model):
    cfg = model.config
    with pytest.raises(ValueError, match=r"reaches compression ratios in \[0\.000, 0\.800\]"):
        kvkit.get_policy("snapkv", compression_ratio=0.9, protect_heads=0.2)
    with pytest.raises(ValueError, match=r"zipcache.*out of reach.*reaches compression ratios in \[0\.7"):
        kvkit.get_policy("zipcache", compression_ratio=0.5).bits_for(4, 64)  # fp32: 2 to 8 bits keep 1/16 to 1/4
    with pytest.raises(ValueError, match=r"tidal.*reaches compression ratios in \[0\.000, 0\.667\]"):
        kvkit.get_policy("tidal", compression_ratio=0.75).validate(cfg)  # 4 of 12 layers read everything
    with pytest.raises(ValueError, match=r"shadowkv.*reaches compression ratios"):
        kvkit.get_policy("shadowkv", compression_ratio=0.97, chunk_size=8).validate(cfg)


@pytest.mark.parametrize("policy,r", [("snapkv", 0.9), ("cake", 0.9), ("kvzip", 0.9), ("streaming", 0.99),
                                       ("chelsea", 0.9)])
def test_a_ratio_below_the_tokens_a_policy_always_keeps_says_so_once(policy, r, model, monkeypatch):
    """A context too short for the ratio (the policy always keeps its sinks, window, one slot per chunk) is not
    silently read at more bytes: the policy warns, once, with the reads it keeps; a context long enough is quiet."""
    from kvkit.policies import knobs

    monkeypatch.setattr(knobs, "_WARNED", set())
    opts = {} if policy == "streaming" else dict(protect_heads=0)

    def warned(n):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with kvkit.patched(model, policy, compression_ratio=r, **opts), torch.no_grad():
                cache = kvkit.KVCache(model)
                model(input_ids=random_ids(n, seed=5), past_key_values=cache, use_cache=True)
        return [str(x.message) for x in w if "out of reach here" in str(x.message)]

    first = warned(80)
    assert len(first) == 1 and f"{policy}: compression_ratio={r:g}" in first[0] and "of full's KV bytes" in first[0]
    assert warned(80) == []  # once per policy and ratio
    monkeypatch.setattr(knobs, "_WARNED", set())
    assert warned(2000) == []


def test_a_ratio_the_calibrated_setting_cannot_reach_is_refused_as_such_not_as_a_malformed_file():
    """Qwen2.5-Coder-0.5B's shipped tidal layers read every token in 8 of its 24 layers, so r = 0.75 is out of reach
    with them: the refusal says so, with the reachable range and the calibrated field, and does not call the
    shipped file malformed; the paper's layout reaches it."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(num_hidden_layers=24, num_key_value_heads=2, num_attention_heads=14, hidden_size=896,
                      vocab_size=151936, intermediate_size=4864)
    with pytest.raises(ValueError, match=r"out of reach.*\[0\.000, 0\.667\].*select_layers") as e:
        kvkit.get_policy("tidal", compression_ratio=0.75).validate(cfg)
    assert "malformed" not in str(e.value)
    kvkit.get_policy("tidal", compression_ratio=0.75, preset="paper").validate(cfg)


def test_a_static_cache_asks_for_the_prompt_length_a_ratio_is_resolved_for(model):
    with pytest.raises(ValueError, match="static cache needs.*pass prompt_length="):
        kvkit.KVCache(model, "snapkv", compression_ratio=0.5, static=True, max_length=64)
    assert kvkit.KVCache(model, "snapkv", compression_ratio=0.5, static=True, max_length=64, prompt_length=48)


@pytest.mark.parametrize("policy", kvkit.available_policies())
def test_every_policy_lists_compression_ratio_and_preset(policy):
    opts = kvkit.policy_options(policy)
    assert opts["compression_ratio"] is None and opts["preset"] == "kvkit"


def test_shadowkv_keeps_the_ratio_below_its_paper_prompt_threshold(model):
    """Without compression_ratio ShadowKV leaves a prompt of at most 4,096 tokens whole (the paper's long-context
    threshold); with it, the ratio holds on such a prompt too, and a min_prompt given still wins."""
    ids = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    full = read_bytes(model, "full", ids)
    assert read_bytes(model, "shadowkv", ids) >= full  # a short prompt runs as full by default
    assert abs(read_bytes(model, "shadowkv", ids, compression_ratio=0.5) / full - 0.5) <= 0.025
    assert read_bytes(model, "shadowkv", ids, compression_ratio=0.5, min_prompt=4096) >= full
