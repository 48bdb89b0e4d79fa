"""kvzip: context-reconstruction scores against the model's own attention, what is kept, the pass's side effects."""

import pytest
import torch

import kvkit
from kvkit.policies.kvzip import KVzipStore
from kvkit.testing import random_ids, tiny_model
from kvkit.testing import reconstruction_scores_reference as _reference_scores

OPTS = dict(budget=20, window=4, sink=2, chunk=10, overlap=3, tail=4, adaptive=False)


def test_scores_are_the_models_attention_while_repeating_the_context():
    model = tiny_model("llama", num_hidden_layers=2)  # GQA: 4 query heads over 2 KV heads
    ids = random_ids(47, seed=3)
    with torch.no_grad():
        ref = _reference_scores(model, ids, OPTS["chunk"], OPTS["overlap"])
        kvkit.patch(model, "kvzip", **dict(OPTS, budget=30))
        try:
            cache = kvkit.KVCache(model)
            model(input_ids=ids, **kvkit.compat.cache_kw(cache), use_cache=True)
        finally:
            kvkit.unpatch(model)
    assert cache.get_seq_length() == ids.shape[1]
    for li, st in enumerate(cache.layers):
        assert isinstance(st, KVzipStore)
        kept = st.pos[0].long()  # [H, budget]
        torch.testing.assert_close(st.rscore[0], ref[li].gather(1, kept), rtol=1e-4, atol=1e-6)
        for h in range(kept.shape[0]):  # kept = sinks, window, then the best reconstruction scores
            others = [p for p in range(ids.shape[1]) if p >= OPTS["sink"] and p < ids.shape[1] - OPTS["window"]]
            best = sorted(others, key=lambda p: -float(ref[li, h, p]))[: 30 - OPTS["sink"] - OPTS["window"]]
            want = sorted(set(range(OPTS["sink"])) | set(best) | set(range(ids.shape[1] - OPTS["window"], ids.shape[1])))
            assert kept[h].tolist() == want


def _kept_scores(extra: dict, transform):
    """Compress a 47-token prompt with ``extra`` options; per layer the kept slots' scores and the reference's."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = random_ids(47, seed=3)
    with torch.no_grad():
        ref = transform(_reference_scores(model, ids, OPTS["chunk"], OPTS["overlap"],
                                          normalize=extra.get("normalize", "held"), sink=OPTS["sink"]))
        kvkit.patch(model, "kvzip", **dict(OPTS, budget=30, **extra))
        try:
            cache = kvkit.KVCache(model)
            model(input_ids=ids, **kvkit.compat.cache_kw(cache), use_cache=True)
        finally:
            kvkit.unpatch(model)
    return [(st.rscore[0], ref[li].gather(1, st.pos[0].long())) for li, st in enumerate(cache.layers)]


def test_chunk_normalisation_is_the_references_local_softmax():
    for got, want in _kept_scores(dict(normalize="chunk"), lambda r: r):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    held = _kept_scores({}, lambda r: r)
    assert any(not torch.allclose(g, w) for (g, _), (w, _) in zip(held, _kept_scores(dict(normalize="chunk"),
                                                                                     lambda r: r)))


def test_compresses_once_the_prompt_exceeds_the_budget_and_leaves_no_trace():
    model = tiny_model("qwen2")
    ids = random_ids(60, seed=5)
    kvkit.patch(model, "kvzip", **OPTS)
    try:
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            out = model(input_ids=ids, **kvkit.compat.cache_kw(cache), use_cache=True)
            assert cache.get_seq_length() == 60  # the repeat was rolled back
            assert cache.num_slots() == [OPTS["budget"]] * len(cache.layers)
            assert all(bool((st.rscore >= 0).all()) for st in cache.layers)  # every kept slot was scored
            assert all(st.obs.shape[2] >= OPTS["window"] for st in cache.layers)  # the prefill's queries stay
            # decoding appends; every `tail` tokens above the budget the bound is restored
            nxt = out.logits[:, -1:].argmax(-1)
            for _ in range(OPTS["tail"] + 2):
                out = model(input_ids=nxt, **kvkit.compat.cache_kw(cache), use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
                assert max(cache.num_slots()) < OPTS["budget"] + OPTS["tail"] + 1
            assert cache.get_seq_length() == 60 + OPTS["tail"] + 2
    finally:
        kvkit.unpatch(model)


def test_short_prompt_is_not_reconstructed():
    model = tiny_model("llama")
    calls = []
    kvkit.patch(model, "kvzip", **OPTS)
    try:
        orig = KVzipStore._score_chunk
        KVzipStore._score_chunk = lambda self, *a: calls.append(1) or orig(self, *a)
        with torch.no_grad():
            model.generate(random_ids(15, seed=1), max_new_tokens=4, do_sample=False)
    finally:
        KVzipStore._score_chunk = orig
        kvkit.unpatch(model)
    assert calls == []


def test_embeddings_without_ids_are_refused():
    model = tiny_model("llama")
    ids = random_ids(40, seed=1)
    kvkit.patch(model, "kvzip", **OPTS)
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="input_ids"):
            model(inputs_embeds=model.get_input_embeddings()(ids), use_cache=True)
    finally:
        kvkit.unpatch(model)


def test_sweeps_refuse_a_replayed_prefill():
    from kvkit.evals.shared_prefill import replayable

    assert not replayable("kvzip")


@pytest.mark.parametrize("bad", [dict(budget=0), dict(chunk=0), dict(overlap=-1), dict(sink=1.5), dict(normalize="all"),
                                 dict(budget=10, window=8, sink=2)])
def test_bad_options(bad):
    with pytest.raises(ValueError, match="kvzip"):
        kvkit.get_policy("kvzip", **bad)


class _Tok:
    """A stand-in tokenizer: one id per character (offset into the tiny vocabulary), a two-tag chat template."""

    chat_template = "x"

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 50 for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "<u>" + messages[0]["content"] + "</u><a>"


def test_instruct_puts_the_instruction_and_answer_header_before_each_chunk(monkeypatch):
    import transformers

    from kvkit.policies.kvzip import INSTRUCTION_FIRST, INSTRUCTION_NEXT

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Tok())
    model = tiny_model("llama")
    ids = random_ids(25, seed=7)
    seen = []
    hook = model.base_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True)
    kvkit.patch(model, "kvzip", **dict(OPTS, instruct=True))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)
    finally:
        hook.remove()
        kvkit.unpatch(model)
    t = _Tok()
    enc = lambda s: torch.tensor(t.encode(s))[None]  # noqa: E731
    head = enc("</u><a>")
    c, o = OPTS["chunk"], OPTS["overlap"]
    want = [torch.cat([enc(INSTRUCTION_FIRST), head, ids[:, :5]], 1),  # 25 = 5 + 10 + 10, cut from the end
            torch.cat([enc(INSTRUCTION_NEXT), ids[:, 5 - o:5], head, ids[:, 5:15]], 1),
            torch.cat([enc(INSTRUCTION_NEXT), ids[:, 15 - o:15], head, ids[:, 15:25]], 1)]
    assert len(seen) == 4 and torch.equal(seen[0], ids)
    for got, w in zip(seen[1:], want):
        assert torch.equal(got, w)
    assert c == 10


def test_instruct_without_a_tokenizer_is_refused_clearly():
    model = tiny_model("llama")  # a random model from a config: no tokenizer files
    kvkit.patch(model, "kvzip", **dict(OPTS, instruct=True))
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="instruct=True needs the model's tokenizer"):
            model(input_ids=random_ids(40, seed=1), use_cache=True)
    finally:
        kvkit.unpatch(model)


def test_reconstruction_near_the_trained_context_stays_inside_it():
    """A context a few tokens short of max_position_embeddings: the repeat would run past it, so its positions are
    shifted back (only the scores' RoPE moves) instead of the forward being refused as beyond the context."""
    model = tiny_model("llama", max_position_embeddings=64)
    ids = random_ids(60, seed=9)
    seen_pos = []
    hook = model.base_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen_pos.append(kwargs.get("position_ids")), with_kwargs=True)
    kvkit.patch(model, "kvzip", **OPTS)
    try:
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            model(input_ids=ids, **kvkit.compat.cache_kw(cache), use_cache=True)
    finally:
        hook.remove()
        kvkit.unpatch(model)
    assert cache.get_seq_length() == 60 and cache.num_slots()[0] == OPTS["budget"]
    repeats = [p for p in seen_pos[1:] if p is not None]
    assert len(repeats) == 6 and all(int(p.max()) <= 63 for p in repeats)


def test_adaptive_shares_the_budget_across_layers():
    """adaptive (the default; the reference's global ranking, head-uniform within a layer): layers keep different
    numbers of slots, about budget x layers in all, each at least sink + window + 1."""
    model = tiny_model("llama", num_hidden_layers=4)
    kvkit.patch(model, "kvzip", **{k: v for k, v in OPTS.items() if k != "adaptive"})  # the default
    try:
        with torch.no_grad():
            cache = kvkit.KVCache(model)
            model(input_ids=random_ids(60, seed=1), **kvkit.compat.cache_kw(cache), use_cache=True)
    finally:
        kvkit.unpatch(model)
    slots = cache.num_slots()
    assert len(set(slots)) > 1 and abs(sum(slots) - 4 * OPTS["budget"]) <= 4
    assert min(slots) >= OPTS["sink"] + OPTS["window"] + 1
    assert [st.budget for st in cache.layers] == slots  # decode-time evictions keep each layer's share
