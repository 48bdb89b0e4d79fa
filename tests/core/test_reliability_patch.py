"""Reliability of the patch seam, one group of tests per guarantee: a user's cache is used or refused, never replaced; the layer store is bound per call (threads); a deep copy
of a patched model is an independent patched model; ``cache_implementation=`` runs the policy or is refused; every
``generate`` entry point is context-checked; transformers' assisted / prompt-lookup generation works on every policy
with exact rollback and is refused up front on the others.
"""

import copy
import gc
import threading

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

import kvkit
from kvkit.compat import cache_kw, output_cache
from kvkit.registry import policy_class
from kvkit.testing import random_ids, tiny_model, tiny_options
from tests._nostatic import no_static_policy

STREAMING = dict(budget=16, sink=2, tail=4)


def _opts(policy):
    return tiny_options(policy)


class _Forwards:
    """Counts the forwards of a model (to show that a refusal came before anything ran)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, *args):
        self.n += 1

    def remove(self):
        self.handle.remove()


# ---- 3: a cache the user passes is used or refused, never silently replaced -----------------------------------
@torch.no_grad()
def test_users_dynamic_cache_is_used_under_full():
    model = tiny_model("llama")
    ids = random_ids(30, seed=1)
    ref_cache = DynamicCache()
    first = model(ids, past_key_values=ref_cache, use_cache=True).logits[:, -1]
    nxt = first.argmax(-1, keepdim=True)
    ref = model(nxt, past_key_values=ref_cache, use_cache=True).logits[:, -1]
    kvkit.patch(model, "full")
    try:
        c = DynamicCache()
        out = model(ids, past_key_values=c, use_cache=True)  # the old argument name included
        assert output_cache(out) is c and c.get_seq_length() == 30
        out = model(nxt, past_key_values=c, use_cache=True)
        assert c.get_seq_length() == 31
        torch.testing.assert_close(out.logits[:, -1], ref, rtol=1e-5, atol=1e-5)
        c2 = DynamicCache()
        model(input_ids=ids, **cache_kw(c2), use_cache=True)  # the current argument name
        assert c2.get_seq_length() == 30
    finally:
        kvkit.unpatch(model)


@pytest.mark.parametrize("filled", [False, True], ids=["empty", "filled"])
@torch.no_grad()
def test_users_transformers_cache_refused_by_a_compressing_policy(filled):
    model = tiny_model("llama")
    ids = random_ids(30, seed=1)
    c = DynamicCache()
    if filled:
        model(ids[:, :10], past_key_values=c, use_cache=True)
    kvkit.patch(model, "streaming", **STREAMING)
    count = _Forwards(model.model.layers[0])
    try:
        with pytest.raises(ValueError, match=r"DynamicCache.*'streaming'.*kvkit\.KVCache\(model\)"):
            model(ids, past_key_values=c, use_cache=True)
        with pytest.raises(ValueError, match=r"kvkit\.KVCache\(model\)"):
            model.generate(ids, past_key_values=c, max_new_tokens=4, do_sample=False)
        assert count.n == 0  # refused before any layer ran
        assert c.get_seq_length() == (10 if filled else 0)  # untouched
        # what the message says works: a KVCache carries the context from call to call
        kc = kvkit.KVCache(model)
        nxt = model(ids, past_key_values=kc, use_cache=True).logits[:, -1:].argmax(-1)
        model(nxt, past_key_values=kc, use_cache=True)
        assert kc.get_seq_length() == 31
    finally:
        count.remove()
        kvkit.unpatch(model)


def test_generate_without_a_cache_still_gets_the_policys_cache():
    model = tiny_model("llama")
    kvkit.patch(model, "streaming", **STREAMING)
    try:
        out = model.generate(random_ids(40), max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        assert isinstance(out.past_key_values, kvkit.KVCache) and out.past_key_values.policy.name == "streaming"
        assert out.past_key_values.num_slots()[0] <= STREAMING["budget"] + STREAMING["tail"]
    finally:
        kvkit.unpatch(model)


# ---- 4: the layer store is bound per call: one patched model, several threads ----------------------------------
@pytest.mark.parametrize("policy", ["streaming", "tidal"])
def test_threads_generating_on_one_patched_model_get_their_own_tokens(policy):
    model = tiny_model("llama")
    kvkit.patch(model, policy, **_opts(policy))
    try:
        prompts = [random_ids(36 + 5 * i, seed=10 + i) for i in range(4)]
        ref = [model.generate(p, max_new_tokens=16, do_sample=False) for p in prompts]
        got, errors = {}, []
        start = threading.Barrier(4)

        def work(i):
            try:
                start.wait()
                for r in range(3):
                    got[i, r] = model.generate(prompts[i], max_new_tokens=16, do_sample=False)
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(repr(e))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        wrong = [(i, r) for (i, r), out in got.items() if not torch.equal(out, ref[i])]
        assert len(got) == 12 and not wrong, wrong
    finally:
        kvkit.unpatch(model)
    assert not any(hasattr(m, "_kvkit_store") for m in model.modules())  # nothing left on the shared modules


# ---- 5: deepcopy of a patched model is an independent patched model ----------------------------------------------
def test_deepcopy_of_a_patched_model_is_independent():
    model = tiny_model("llama")
    ids = random_ids(48, seed=2)
    full = model.generate(ids, max_new_tokens=12, do_sample=False)
    kvkit.patch(model, "streaming", **STREAMING)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert not torch.equal(ref, full)  # the policy really changes these tokens
    twin = copy.deepcopy(model)
    assert kvkit.patched_policy(twin) == kvkit.patched_policy(model)
    assert kvkit.patched_policy(twin) is not kvkit.patched_policy(model)
    assert torch.equal(twin.generate(ids, max_new_tokens=12, do_sample=False), ref)
    kvkit.unpatch(model)  # the copy keeps its policy
    assert torch.equal(twin.generate(ids, max_new_tokens=12, do_sample=False), ref)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), full)
    kvkit.patch(model, "tidal", budget=8)  # re-patching the original does not reach the copy
    assert kvkit.patched_policy(twin).name == "streaming"
    out = twin.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.past_key_values.policy.name == "streaming"
    del model, out
    gc.collect()
    assert torch.equal(twin.generate(ids, max_new_tokens=12, do_sample=False), ref)  # the original is gone
    kvkit.unpatch(twin)
    assert torch.equal(twin.generate(ids, max_new_tokens=12, do_sample=False), full)
    assert "generate" not in vars(twin) and twin.config._attn_implementation == "sdpa"


def test_unpatching_the_copy_leaves_the_original_patched():
    model = tiny_model("llama")
    ids = random_ids(48, seed=2)
    kvkit.patch(model, "streaming", **STREAMING)
    try:
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)
        twin = copy.deepcopy(model)
        kvkit.unpatch(twin)
        assert kvkit.patched_policy(twin) is None and "generate" not in vars(twin)
        assert not twin._forward_pre_hooks and not twin.model._forward_pre_hooks
        assert kvkit.patched_policy(model).name == "streaming" and model.config._attn_implementation == "kvkit"
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), ref)
    finally:
        kvkit.unpatch(model)


def test_copying_only_a_part_of_a_patched_model_is_refused():
    model = tiny_model("llama")
    kvkit.patch(model, "streaming", **STREAMING)
    try:
        with pytest.raises(TypeError, match=r"deep-copy the whole model|kvkit\.unpatch"):
            copy.deepcopy(model.model)  # its hook would run for a model it is not part of
        copy.deepcopy(model.model.layers[0])  # a layer holds no reference to the model: fine
    finally:
        kvkit.unpatch(model)


# ---- 6: cache_implementation= runs the policy or is refused ------------------------------------------------------
@pytest.mark.parametrize("how", ["kwarg", "generation_config", "model_default"])
def test_cache_implementation_static_runs_the_policys_static_cache(how):
    model = tiny_model("llama")
    ids = random_ids(40, seed=3)
    kvkit.patch(model, "streaming", **STREAMING)
    try:
        ref = model.generate(ids, max_new_tokens=10, do_sample=False)
        if how == "kwarg":
            out = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="static",
                                 return_dict_in_generate=True)
        elif how == "generation_config":
            gcfg = GenerationConfig(max_new_tokens=10, do_sample=False, cache_implementation="static",
                                    return_dict_in_generate=True)
            out = model.generate(ids, gcfg)
        else:
            model.generation_config.cache_implementation = "static"
            out = model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
        cache = out.past_key_values
        assert isinstance(cache, kvkit.KVCache) and cache.policy.name == "streaming" and cache.is_compileable
        assert torch.equal(out.sequences, ref)
    finally:
        model.generation_config.cache_implementation = None
        kvkit.unpatch(model)


@pytest.mark.parametrize("policy,impl", [("nostatic", "static"), ("streaming", "offloaded"),
                                         ("streaming", "quantized"), ("streaming", "offloaded_static")])
def test_cache_implementation_refused_where_it_would_bypass_the_policy(policy, impl):
    with no_static_policy():  # "nostatic": a policy without a static store (every built-in one has one)
        model = tiny_model("llama")
        kvkit.patch(model, policy, **_opts(policy))
        count = _Forwards(model)
        try:
            with pytest.raises(ValueError, match=rf"cache_implementation='{impl}'.*{policy}"):
                model.generate(random_ids(30), max_new_tokens=4, do_sample=False, cache_implementation=impl)
            assert count.n == 0
        finally:
            count.remove()
            kvkit.unpatch(model)


# ---- 13: every generate entry point goes through the context check ---------------------------------------------
@pytest.mark.parametrize("how", ["positional", "inputs", "input_ids", "inputs_embeds", "generation_config",
                                 "generation_config_kw", "generation_config_max_length", "max_length"])
def test_every_generate_entry_point_is_context_checked(how):
    model = tiny_model("llama", max_position_embeddings=32)
    ids = random_ids(28)
    kvkit.patch(model, "streaming", **STREAMING)
    count = _Forwards(model)
    calls = {
        "positional": lambda: model.generate(ids, max_new_tokens=8, do_sample=False),
        "inputs": lambda: model.generate(inputs=ids, max_new_tokens=8, do_sample=False),
        "input_ids": lambda: model.generate(input_ids=ids, max_new_tokens=8, do_sample=False),
        "inputs_embeds": lambda: model.generate(inputs_embeds=model.get_input_embeddings()(ids).detach(),
                                                max_new_tokens=8, do_sample=False),
        "generation_config": lambda: model.generate(ids, GenerationConfig(max_new_tokens=8, do_sample=False)),
        "generation_config_kw": lambda: model.generate(
            ids, generation_config=GenerationConfig(max_new_tokens=8, do_sample=False)),
        "generation_config_max_length": lambda: model.generate(ids, GenerationConfig(max_length=36, do_sample=False)),
        "max_length": lambda: model.generate(ids, max_length=36, do_sample=False),
    }
    try:
        with pytest.raises(ValueError, match=r"prompt 28 \+ max_new_tokens 8"):
            calls[how]()
        assert count.n == 0, "the model ran before the request was refused"
    finally:
        count.remove()
        kvkit.unpatch(model)


# ---- 14: transformers' assisted and prompt-lookup generation ----------------------------------------------------
def _repetitive_prompt():
    ids = random_ids(60, seed=3)
    return torch.cat([ids, ids[:, :20], ids[:, :20]], 1)  # 100 tokens, n-grams repeat: prompt lookup finds some


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("policy", kvkit.available_policies())
def test_assisted_generation_on_every_policy(policy, mode, monkeypatch):
    model = tiny_model("llama")
    ids = _repetitive_prompt()
    if mode == "assistant":
        small = tiny_model("llama", seed=5, num_hidden_layers=1)
        small.generation_config.assistant_confidence_threshold = 0.0  # rounds of many candidates
        kw = dict(assistant_model=small)
    else:
        kw = dict(prompt_lookup_num_tokens=3)
    kvkit.patch(model, policy, **_opts(policy))
    try:
        ref = model.generate(ids, max_new_tokens=24, do_sample=False)
        reason = policy_class(policy).speculative_refusal
        if reason is not None:
            count = _Forwards(model)
            try:
                with pytest.raises(ValueError, match=rf"assisted generation.*'{policy}'.*not lossless"):
                    model.generate(ids, max_new_tokens=24, do_sample=False, **kw)
                assert count.n == 0
            finally:
                count.remove()
            return
        crops = []
        crop = kvkit.KVCache.crop
        monkeypatch.setattr(kvkit.KVCache, "crop", lambda self, n: (crops.append(n), crop(self, n))[1])
        out = model.generate(ids, max_new_tokens=24, do_sample=False, **kw)
        assert any(n < 0 for n in crops), "no candidate was rejected: the test proves nothing"
        if policy in ("full", "streaming", "shadowkv", "tidal"):  # their rounds decode as one-token steps do
            assert torch.equal(out, ref)
        else:
            assert out.shape == ref.shape and torch.equal(out[:, :100], ids)
    finally:
        kvkit.unpatch(model)


def test_first_round_keeps_the_prefill_of_plain_generate(monkeypatch):
    """The first assisted forward carries prompt + candidates; the policy still prefills (and compresses) exactly the
    prompt, as in plain generate, and the candidates stay croppable."""
    model = tiny_model("llama")
    ids = _repetitive_prompt()
    kvkit.patch(model, "streaming", **_opts("streaming"))
    try:
        seen = []
        from kvkit.stores.scored import ScoredStore

        on_prefill = ScoredStore.on_prefill
        monkeypatch.setattr(ScoredStore, "on_prefill",
                            lambda self, q, m: (seen.append(self.seen), on_prefill(self, q, m)))
        model.generate(ids, max_new_tokens=1, do_sample=False)
        plain, seen[:] = list(seen), []
        model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=8, do_sample=False)
        assert seen == plain == [100] * 3
    finally:
        kvkit.unpatch(model)
