"""The contract every registered policy keeps (one test per rule, parametrized over ``kvkit.available_policies()``).

Per-policy test files keep only what is specific to their method; a new policy is covered here by its tiny-model
options in ``kvkit.testing.TEST_OPTIONS`` and ``covering_options`` (a lossless setting) on its dataclass.
"""

import dataclasses

import pytest
import torch

import kvkit
from kvkit.registry import policy_class
from kvkit.testing import greedy, left_padded_batch, policy_test_options, random_ids, tiny_model

POLICIES = kvkit.available_policies()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", POLICIES)
def test_equals_full_when_the_budget_covers_everything(policy, arch):
    cover = policy_class(policy).covering_options
    if cover is None:
        pytest.skip(f"{policy} has no lossless setting (covering_options = None)")
    model = tiny_model(arch)
    ids = random_ids(70, seed=1)
    ref_toks, ref_logits, _ = greedy(model, ids, 10)
    kvkit.patch(model, policy, **cover)
    try:
        toks, logits, cache = greedy(model, ids, 10)
    finally:
        kvkit.unpatch(model)
    assert isinstance(cache, kvkit.KVCache) and cache.policy.name == policy
    assert torch.equal(toks, ref_toks)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", POLICIES)
def test_crop_is_exact(policy):
    """Decode 3 tokens, crop the last 2, decode them again: the same logits as the first time."""
    model = tiny_model("llama")
    ids = random_ids(48, seed=2)
    kvkit.patch(model, policy, **policy_test_options(policy))
    try:
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            toks, first = [], []
            nxt = out.logits[:, -1:].argmax(-1)
            for _ in range(3):
                toks.append(nxt)
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                first.append(out.logits[:, -1])
                nxt = out.logits[:, -1:].argmax(-1)
            seen = cache.get_seq_length()
            cache.crop(-2)
            assert cache.get_seq_length() == seen - 2
            for t, ref in zip(toks[1:], first[1:]):
                out = model(input_ids=t, past_key_values=cache, use_cache=True)
                torch.testing.assert_close(out.logits[:, -1], ref, rtol=1e-5, atol=1e-5)
            with pytest.raises(ValueError):
                cache.crop(-(seen + 1))  # more than was ever seen: refused, nothing changes
            assert cache.get_seq_length() == seen
    finally:
        kvkit.unpatch(model)


@torch.no_grad()
def _decode_after_a_round(model, ids, drafts, verify: bool, steps: int = 10) -> torch.Tensor:
    """Prefill ``ids``, decode 3 tokens, ``reserve`` a round of ``[last, drafts]``; with ``verify`` run it as one
    verification forward and crop it all; then decode ``steps`` greedy tokens from ``last``: their logits
    ``[1, steps, V]``."""
    cache = kvkit.KVCache(model)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    for _ in range(3):
        out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    k = drafts.shape[1] + 1
    cache.reserve(k)
    if verify:
        seen = cache.get_seq_length()
        with cache.verification():
            model(input_ids=torch.cat([nxt, drafts], 1), past_key_values=cache, use_cache=True)
        cache.crop(-k)
        assert cache.get_seq_length() == seen
    logits = []
    for _ in range(steps):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("policy", POLICIES)
def test_crop_after_verification_equals_never_seeing_the_tokens(policy, static):
    """``reserve(k)``, a verification forward of ``k`` tokens, ``crop(-k)``: the store is back where it was (held
    slots, the statistics its queries fed: scores, saliencies, observation windows), so the next tokens (and the
    compression events among them) decode as in a cache that never saw the round."""
    if static and not policy_class(policy).static_capable:
        pytest.skip(f"{policy} has no static stores")
    model = tiny_model("llama")
    ids, drafts = random_ids(40, seed=3), random_ids(4, seed=9)
    kvkit.patch(model, policy, static=static, **policy_test_options(policy))
    try:
        torch.testing.assert_close(_decode_after_a_round(model, ids, drafts, verify=True),
                                   _decode_after_a_round(model, ids, drafts, verify=False), rtol=1e-5, atol=1e-5)
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("policy", POLICIES)
def test_left_padded_batch_equals_each_prompt_alone(policy, arch):
    model = tiny_model(arch)
    ids, mask, prompts = left_padded_batch((40, 27), seed=4)
    kvkit.patch(model, policy, **policy_test_options(policy))
    try:
        toks, logits, _ = greedy(model, ids, 8, attention_mask=mask)
        for row, p in enumerate(prompts):
            t1, l1, _ = greedy(model, p[None], 8)
            assert torch.equal(toks[row], t1[0]), f"row {row}"
            for a, b in zip(logits, l1):
                torch.testing.assert_close(a[row], b[0], rtol=1e-4, atol=1e-4)
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("policy", POLICIES)
def test_bytes_are_reported(policy):
    model = tiny_model("llama", num_hidden_layers=4)  # TidalDecode reads less from layer 3 on
    ids = random_ids(120, seed=5)
    kvkit.patch(model, "full")
    _, _, full = greedy(model, ids, 4)
    kvkit.patch(model, policy, **policy_test_options(policy, 4))
    try:
        _, _, cache = greedy(model, ids, 4)
    finally:
        kvkit.unpatch(model)
    held, read = cache.nbytes(), cache.read_nbytes()
    assert held > 0 and read > 0 and cache.offloaded_nbytes() >= 0
    assert len(cache.nbytes(per_layer=True)) == model.config.num_hidden_layers
    saves = policy_class(policy).saves
    if "memory" in saves:
        assert held < full.nbytes(), f"{policy} claims to save memory but holds {held} >= full's {full.nbytes()}"
    if "reads" in saves:
        assert read < full.read_nbytes(), f"{policy} claims to save reads but reads {read} >= {full.read_nbytes()}"


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_options_are_refused(policy):
    with pytest.raises(ValueError, match="valid options"):
        kvkit.get_policy(policy, no_such_option=1)
    fields = {f.name for f in dataclasses.fields(policy_class(policy))}
    for name in ("budget", "window", "chunk_size", "tail", "requant_interval"):
        if name in fields:
            for bad in (-3, True, 2.5) + ((0,) if name != "window" else ()):  # a window of 0 can be valid
                with pytest.raises(ValueError, match=name):
                    kvkit.get_policy(policy, **{name: bad})
    for name in ("kernel", "pool_kernel", "protect_kernel"):  # pooling kernels: one check, one message
        if name in fields:
            for bad in (4, 0, -1, True, 2.5, "5"):
                with pytest.raises(ValueError, match=f"{policy}: {name} must be a positive odd integer"):
                    kvkit.get_policy(policy, **{name: bad})
            kvkit.get_policy(policy, **{name: 1})


@pytest.mark.parametrize("policy", POLICIES)
def test_compressing_cache_refused_on_an_unpatched_model(policy):
    """Never silently wrong output without kvkit's attention."""
    model = tiny_model("llama")
    ids = random_ids(40, seed=6)
    cache = kvkit.KVCache(model, policy, **policy_test_options(policy))
    if not any(layer.needs_kvkit_attention for layer in cache.layers):  # full: transformers' own layers
        ref, _, _ = greedy(model, ids, 5)
        out, _, _ = greedy(model, ids, 5, cache=cache)
        assert torch.equal(out, ref)
        return
    with pytest.raises(RuntimeError, match="kvkit.patch"):
        model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=cache)
