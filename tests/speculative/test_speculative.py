"""kvkit.speculative: lossless self-speculative decoding (greedy equality, sampling distribution, cache state)."""

import copy

import pytest
import torch

import kvkit
from kvkit.patch import is_patched
from kvkit.speculative import DraftCache, SpeculativeStats, StreamingView, generate
from kvkit.testing import greedy, tiny_model

VIEWS = {"streaming": {"budget": 20, "sink": 4}, "retrieval": {"budget": 24, "chunk": 8}}


def _prompt(n, seed=1, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


@pytest.mark.parametrize(
    "arch,policy,gammas",
    [("llama", "streaming", (1, 3, 5)), ("llama", "retrieval", (2, 6)), ("qwen2", "retrieval", (3,)),
     ("mistral", "streaming", (4,)), ("gemma3_text", "streaming", (2,)), ("gemma3_text", "retrieval", (3,))],
)
def test_greedy_equals_plain_greedy(arch, policy, gammas):
    m = tiny_model(arch)
    ids = _prompt(90)
    ref, _, _ = greedy(m, ids, 14)
    for gamma in gammas:
        st = SpeculativeStats()
        out = generate(m, ids, draft_policy=policy, draft_options=VIEWS[policy], gamma=gamma, max_new_tokens=14,
                       eos_token_id=None, stats=st)
        assert torch.equal(out[0, 90:], ref[0]), (arch, policy, gamma)
        assert st.new_tokens == 14 and st.drafted >= st.accepted >= 0 and st.rounds > 0
    assert not is_patched(m)  # patched only for the call


def test_draft_really_is_sparse_and_rejections_happen():
    # a 4-token view of a random model must disagree sometimes: otherwise the equality tests prove nothing
    m = tiny_model("llama")
    ids = _prompt(120)
    st = SpeculativeStats()
    generate(m, ids, draft_options={"budget": 4, "sink": 1}, gamma=4, max_new_tokens=16, eos_token_id=None, stats=st)
    assert st.acceptance_rate < 1.0
    kvkit.patch(m, "full")
    cache = kvkit.KVCache(m)
    m(input_ids=ids, past_key_values=cache, use_cache=True)
    dc = DraftCache(cache, StreamingView(budget=8, sink=2))
    dc.begin_round()
    m(input_ids=ids[:, :3], past_key_values=dc, use_cache=True)
    assert cache.get_seq_length() == 120  # draft tokens never enter the real cache
    assert dc.get_seq_length() == 123
    assert all(layer.num_slots() == 8 + 3 for layer in dc.layers)  # view + draft tail, no full copy
    dc.layers[0].crop(-2)
    assert dc.layers[0].get_seq_length() == 121
    dc.layers[0].crop(0)  # transformers' crop(-0): nothing to remove
    assert dc.layers[0].get_seq_length() == 121
    kvkit.unpatch(m)


def test_hierarchical_greedy_with_assistant():
    m = tiny_model("llama")
    small = tiny_model("llama", seed=5, num_hidden_layers=1)
    ids = _prompt(60)
    ref, _, _ = greedy(m, ids, 10)
    st = SpeculativeStats()
    out = generate(m, ids, gamma=3, assistant=small, assistant_gamma=2, draft_options=VIEWS["streaming"],
                   assistant_cache={"policy": "streaming", "budget": 16, "sink": 4}, max_new_tokens=10,
                   eos_token_id=None, stats=st)
    assert torch.equal(out[0, 60:], ref[0])
    assert st.assistant_drafted > 0
    assert not is_patched(small)


@pytest.mark.parametrize("n,gamma,assistant_gamma", [(200, 6, 4), (120, 5, 3)])
def test_hierarchical_assistant_cache_past_its_budget(n, gamma, assistant_gamma):
    # the assistant's StreamingLLM cache is far past its budget and is rolled back after every assistant
    # round inside a top-level round; it must not compress there (it used to, then the top-level
    # rejection asked it to crop tokens it had already evicted: "cannot crop 7 tokens exactly")
    m = tiny_model("llama")
    small = tiny_model("llama", seed=5, num_hidden_layers=1)
    ids = _prompt(n, seed=n)
    ref, _, _ = greedy(m, ids, 40)
    st = SpeculativeStats()
    out = generate(m, ids, gamma=gamma, assistant=small, assistant_gamma=assistant_gamma, draft_policy="retrieval",
                   draft_options={"budget": 48, "chunk": 8}, assistant_cache={"policy": "streaming", "budget": 32, "sink": 4},
                   max_new_tokens=40, eos_token_id=None, stats=st)
    assert torch.equal(out[0, n:], ref[0])
    assert st.assistant_drafted > 0 and st.rounds > 1


def test_adaptive_gamma_stays_lossless():
    m = tiny_model("qwen2")
    ids = _prompt(80)
    ref, _, _ = greedy(m, ids, 12)
    st = SpeculativeStats()
    out = generate(m, ids, gamma=6, adaptive=0.9, max_new_tokens=12, eos_token_id=None, stats=st)
    assert torch.equal(out[0, 80:], ref[0])
    assert st.drafted < 6 * st.rounds  # random model: low confidence stops drafting early


def test_hf_custom_generate_unpatched_and_patched():
    m = tiny_model("llama")
    ids = _prompt(70)
    ref = m.generate(ids, max_new_tokens=12, do_sample=False)
    st = SpeculativeStats()
    out = m.generate(ids, custom_generate=generate, gamma=3, max_new_tokens=12, do_sample=False, stats=st)
    assert torch.equal(out, ref) and st.new_tokens == 12
    kvkit.patch(m, "full")
    out = m.generate(ids, custom_generate=generate, gamma=2, draft_policy="retrieval",
                     draft_options=VIEWS["retrieval"], max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)
    assert kvkit.patched_policy(m).name == "full"  # still patched: the call does not unpatch a user's patch
    kvkit.unpatch(m)


def test_hf_assisted_decoding_with_patched_assistant():
    m = tiny_model("llama")
    small = tiny_model("llama", seed=5, num_hidden_layers=1)
    ids = _prompt(60)
    ref = m.generate(ids, max_new_tokens=12, do_sample=False)
    kvkit.patch(small, "full")
    out = m.generate(ids, assistant_model=small, max_new_tokens=12, do_sample=False)
    kvkit.unpatch(small)
    assert torch.equal(out, ref)


def test_streaming_crop_below_prefill_compression_is_exact():
    """Prefill compresses 40 -> 16 slots; crop(-1) then re-feeding the last prompt token gives exactly the
    logits of a store that prefilled 39 tokens (HF assisted decoding re-feeds it after a rejection)."""
    m = tiny_model("llama")
    ids = _prompt(40)
    kvkit.patch(m, "streaming", budget=16, sink=4, tail=8)
    with torch.no_grad():
        ref_cache = kvkit.KVCache(m)
        m(input_ids=ids[:, :39], past_key_values=ref_cache, use_cache=True)
        ref = m(input_ids=ids[:, 39:], past_key_values=ref_cache, use_cache=True).logits
        cache = kvkit.KVCache(m)
        m(input_ids=ids, past_key_values=cache, use_cache=True)
        assert cache.num_slots() == [16] * 3  # compressed at the prefill
        cache.crop(-1)
        got = m(input_ids=ids[:, 39:], past_key_values=cache, use_cache=True).logits
        with pytest.raises(ValueError, match="cannot crop"):
            cache.crop(-2)  # 38 < 40 - 1: that window was evicted
        assert cache.get_seq_length() == 40
    kvkit.unpatch(m)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("assistant_kind", ["random", "self_copy"])
def test_hf_assisted_decoding_streaming_assistant_prompt_over_budget(assistant_kind, monkeypatch):
    """transformers' assisted decoding with a streaming-patched assistant and a prompt 4x its budget."""
    from kvkit.policies.streaming import StreamingStore

    m = tiny_model("llama")
    if assistant_kind == "random":
        small = tiny_model("llama", seed=5, num_hidden_layers=1)
        # no confidence stop: rounds of 20 candidates, so the window moves on between rollbacks
        small.generation_config.assistant_confidence_threshold = 0.0
    else:  # the target's own weights under a streaming window: long accepted runs, so crop(-0) happens
        small = copy.deepcopy(m)
        small.generation_config.num_assistant_tokens = 3
    ids = _prompt(64)
    ref = m.generate(ids, max_new_tokens=40, do_sample=False)
    crops, compressions = [], []  # (tokens_to_remove, seen, committed) of every crop; seen at each compression
    rollback, compress = StreamingStore.rollback, StreamingStore.compress

    def crop_spy(self, n, ends_round=True):  # every crop of a KVCache goes through its stores' rollback
        crops.append((-n, self.seen, self.committed))
        rollback(self, n, ends_round)

    def compress_spy(self):
        compressions.append(self.seen)
        compress(self)

    monkeypatch.setattr(StreamingStore, "rollback", crop_spy)
    monkeypatch.setattr(StreamingStore, "compress", compress_spy)
    kvkit.patch(small, "streaming", budget=16, sink=4)
    try:
        out = m.generate(ids, assistant_model=small, max_new_tokens=40, do_sample=False)
    finally:
        kvkit.unpatch(small)
    assert torch.equal(out, ref)
    assert crops, "the assistant's cache was never rolled back: the test exercised nothing"
    assert len(compressions) >= 3 and max(s for _, s, _ in crops) > 64 + 16  # evicted again while decoding
    below = [c for c in crops if c[0] < 0 and c[1] + c[0] < c[2]]  # went back below the compression point
    if assistant_kind == "random":
        assert below  # the first candidate after the compressing prefill is rejected
    else:
        assert any(c[0] == 0 for c in crops)  # all candidates accepted: HF calls crop(-0), a no-op


def test_cache_state_equals_plain_decoding():
    m = tiny_model("llama")
    ids = _prompt(100)
    n = 13
    _, _, plain = greedy(m, ids, n - 1)  # plain decoding of n tokens feeds n - 1 of them
    out = generate(m, ids, gamma=4, max_new_tokens=n, eos_token_id=None, return_dict_in_generate=True)
    cache = out.past_key_values
    assert cache.get_seq_length() == plain.get_seq_length() == 100 + n - 1
    for a, b in zip(cache.layers, plain.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)
    assert out.stats.new_tokens == n


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def test_sampling_follows_target_distribution():
    """Chi-square on a 5-token vocabulary: the joint law of the 2nd and 3rd sampled tokens is the target's."""
    V, T = 5, 24
    m = tiny_model("llama", vocab_size=V, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # a peaked, prompt-dependent target (the random init is near uniform)
    ids = _prompt(T, vocab=V)
    temp = 0.8
    # exact target law of (t2, t3) given the prompt: sum over t1
    with torch.no_grad():
        p1 = (m(ids).logits[0, -1] / temp).softmax(-1)
        joint = torch.zeros(V, V, dtype=torch.float64)
        for a in range(V):
            x = torch.cat([ids, torch.tensor([[a]])], 1)
            p2 = (m(x).logits[0, -1] / temp).softmax(-1)
            for b in range(V):
                p3 = (m(torch.cat([x, torch.tensor([[b]])], 1)).logits[0, -1] / temp).softmax(-1)
                joint[b] += p1[a].double() * p2[b].double() * p3.double()
    torch.manual_seed(0)
    N = 200
    counts = torch.zeros(V * V, dtype=torch.float64)
    st = SpeculativeStats()
    kvkit.patch(m, "full")  # once, not per call
    base = kvkit.KVCache(m)
    with torch.no_grad():
        m(input_ids=ids[:, :-1], past_key_values=base, use_cache=True)  # prefill once; each call copies it
    for _ in range(N):
        # 4 new tokens: the first round drafts 2 (a round never drafts past the tokens still needed)
        out = generate(m, ids, past_key_values=copy.deepcopy(base), gamma=2, draft_options={"budget": 3, "sink": 1}, max_new_tokens=4, do_sample=True,
                       temperature=temp, top_k=None, top_p=None, eos_token_id=None, stats=st)
        counts[out[0, T + 1] * V + out[0, T + 2]] += 1
    kvkit.unpatch(m)
    assert 0.05 < st.acceptance_rate < 0.97  # rejections (and residual sampling) really happen
    assert _chi2_pvalue(counts, joint.flatten()) > 1e-3


def test_bad_inputs():
    m = tiny_model("llama")
    ids = _prompt(30)
    small = tiny_model("llama", seed=5, num_hidden_layers=1)
    with pytest.raises(ValueError, match="unknown assistant_cache option"):
        generate(m, ids, assistant=small, assistant_cache={"policy": "streaming", "window": 8}, max_new_tokens=4)
    with pytest.raises(ValueError, match="it takes no tail"):  # a tail used to be accepted and silently dropped
        generate(m, ids, assistant=small, assistant_cache={"policy": "streaming", "budget": 16, "tail": 4},
                 max_new_tokens=4)
    with pytest.raises(ValueError, match="cache policy"):
        generate(m, ids, assistant=small, assistant_cache={"policy": "cake"}, max_new_tokens=4)
    with pytest.raises(ValueError, match="sink"):
        generate(m, ids, assistant=small, assistant_cache={"budget": 8, "sink": 8}, max_new_tokens=4)
    with pytest.raises(ValueError, match="left padding"):
        generate(m, ids.repeat(2, 1), attention_mask=torch.ones(2, 30).index_fill_(1, torch.tensor([29]), 0), max_new_tokens=4)
    for g in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="gamma"):
            generate(m, ids, gamma=g, max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_policy"):
        generate(m, ids, draft_policy="nope", max_new_tokens=4)
    with pytest.raises(ValueError, match="sink"):
        generate(m, ids, draft_options={"budget": 4, "sink": 4}, max_new_tokens=4)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(m, ids, assistant=tiny_model("llama", vocab_size=64), max_new_tokens=4)
    with pytest.raises(ValueError, match="draft must be 'self'"):
        generate(m, ids, draft="other", max_new_tokens=4)
    assert not is_patched(m)


def test_greedy_check_reports_a_broken_verifier(monkeypatch):
    """The identity check (benchmarks/speculative/check_greedy.py) must flag a verifier that accepts bad drafts."""
    import importlib

    from kvkit.speculative.check import check_prompt, format_result

    gen = importlib.import_module("kvkit.speculative.generate")  # the module, not the function it exports

    m = tiny_model("llama")
    ids = _prompt(70)
    settings = [("streaming", {"budget": 8, "sink": 2}, 4)]
    (good,) = check_prompt(m, ids, 10, settings)
    assert good.identical and good.first_mismatch is None
    # accepts every draft of every row
    monkeypatch.setattr(gen, "accept_greedy", lambda drafts, logits: (torch.full((drafts.shape[0],), drafts.shape[1]),
                                                                       logits[:, -1].argmax(-1)))
    (bad,) = check_prompt(m, ids, 10, settings)
    assert not bad.identical and bad.first_mismatch is not None and bad.margin is not None and bad.margin > 0
    assert "first difference at new token" in format_result(bad)
    assert not is_patched(m)


def test_greedy_check_bad_lengths():
    from kvkit.speculative.check import prompt_lengths

    assert prompt_lengths(10, 600, 1200)[::9] == [600, 1200]
    for n, lo, hi in ((0, 600, 1200), (3, 900, 600), (3, 4, 10)):
        with pytest.raises(ValueError):
            prompt_lengths(n, lo, hi)


@pytest.mark.slow
def test_default_model_greedy_ten_long_prompts(default_model):
    """10 prompts of 600-1200 tokens (needle questions and essay continuations) x 12 new tokens on SmolLM2,
    draft settings cycled (streaming / retrieval, budgets 128-512, gamma 2-6): speculative == plain greedy."""
    from kvkit.speculative.check import SETTINGS, check_prompt, make_prompt, prompt_lengths

    model, tok = default_model
    results = []
    for i, length in enumerate(prompt_lengths(10, 600, 1200)):
        kind, ids = make_prompt(tok, i, length)
        assert abs(ids.shape[1] - length) <= 8
        results += check_prompt(model, ids, 12, [SETTINGS[i % len(SETTINGS)]], prompt=i, kind=kind)
    bad = [r for r in results if not r.identical]
    assert not bad, bad
    assert len(results) == 10 and len({r.setting for r in results}) == len(SETTINGS)
    # the drafts are sparse but not useless: otherwise identity would be trivially easy
    assert 0.2 < sum(r.acceptance for r in results) / len(results) < 1.0


@pytest.mark.parametrize("batch", [1, 3])
def test_speculate_cli_self_draft_and_hierarchy_in_one_run(tmp_path, batch):
    # `kvkit speculate --assistant [--batch 3]`: plain, self-draft alone and self-draft under the assistant share
    # one prefill, every row is lossless, and the json marks which rows used the assistant
    import json

    from kvkit.cli import main
    from kvkit.models import load_tokenizer

    tok = load_tokenizer("default")
    dirs = {}
    for name, kw in (("target", {}), ("small", {"seed": 5, "num_hidden_layers": 1})):
        d = tmp_path / name
        tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048, **kw).save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = str(d)
    out = tmp_path / "spec.jsonl"
    code = main(["speculate", "--model", dirs["target"], "--assistant", dirs["small"], "--length", "300",
                 "--new-tokens", "8", "--gamma", "3", "--assistant-gamma", "2", "--draft-policy", "streaming",
                 "--budget", "64", "--batch", str(batch), "--json", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [batch] * 3
    assert [r["setting"].endswith("assistant " + dirs["small"]) for r in rows] == [False, False, True]
    assert [r["assistant"] for r in rows] == [None, None, dirs["small"]]
    assert all(r["same"] for r in rows) and rows[2]["assistant_acceptance"] is not None
    assert rows[1]["assistant_acceptance"] is None and rows[1]["acceptance"] is not None


def test_speculate_cli_repeat_reports_medians_and_phase_costs(tmp_path, capsys, tiny_dir):
    # --repeat 2: plain and each setting run twice, interleaved; the row holds both runs, the median and the
    # per-repeat speedups; draft/verify costs are positive and in plain-step units
    import json
    import statistics

    from kvkit.cli import main

    d = tiny_dir
    out = tmp_path / "spec.jsonl"
    assert main(["speculate", "--model", str(d), "--length", "200", "--new-tokens", "6", "--gamma", "2",
                 "--draft-policy", "retrieval", "--budget", "64", "--repeat", "2", "--baselines", "static,dynamic",
                 "--json", str(out)]) == 0
    plain, static, dynamic, spec = [json.loads(line) for line in out.read_text().splitlines()]
    # the transformers-cache baselines decode the same tokens (exit status 0 checks it) and gets its own speedups
    assert static["setting"] == "plain greedy (transformers StaticCache)" and static["same"] and len(static["tok_s_runs"]) == 2
    assert dynamic["setting"] == "plain greedy (transformers DynamicCache)" and dynamic["same"]
    assert spec["speedup_vs_static"] > 0 and spec["speedup_vs_dynamic"] > 0
    assert len(plain["tok_s_runs"]) == len(spec["tok_s_runs"]) == 2
    assert plain["tok_s"] == pytest.approx(statistics.median(plain["tok_s_runs"]))
    ratios = [s / p for s, p in zip(spec["tok_s_runs"], plain["tok_s_runs"])]
    assert spec["speedup_runs"] == pytest.approx(ratios) and spec["speedup"] == pytest.approx(statistics.median(ratios))
    assert spec["draft_step_vs_plain"] > 0 and spec["verify_vs_plain"] > 0 and spec["same"]
    assert main(["speculate", "--model", str(d), "--length", "200", "--new-tokens", "1"]) != 0
    assert "--new-tokens must be >= 2" in capsys.readouterr().err


def test_stats_count_decode_tokens_without_the_prefill_token():
    m = tiny_model("llama", seed=3)
    ids = torch.randint(0, m.config.vocab_size, (1, 40))
    st = SpeculativeStats()
    generate(m, ids, draft_options={"budget": 16, "sink": 4}, gamma=3, max_new_tokens=10, eos_token_id=None, stats=st)
    assert st.new_tokens == 10 and st.decode_tokens == 9
    assert st.tokens_per_round == pytest.approx(9 / st.rounds)
    assert 0 < st.draft_seconds + st.verify_seconds <= st.decode_seconds


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_explicit_head_logits_equal_the_model_and_nothing_is_swapped(arch):
    # the gamma + 1 logits come from the decoder's hidden states times the head's weight, computed here;
    # no module's forward is replaced at run time
    from kvkit.speculative.forward import explicit_head, logits

    m = tiny_model(arch, seed=4)
    ids = torch.randint(0, m.config.vocab_size, (2, 30))
    head = m.get_output_embeddings()
    with torch.no_grad():
        ref = m(input_ids=ids, logits_to_keep=5).logits
        out = logits(m, 5, input_ids=ids)
    assert explicit_head(m) is head and "forward" not in vars(head)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_explicit_head_falls_back_for_a_final_logit_softcap():
    from kvkit.speculative.forward import explicit_head, logits

    m = tiny_model("gemma2", seed=4, final_logit_softcapping=3.0)
    ids = torch.randint(0, m.config.vocab_size, (1, 12))
    assert explicit_head(m) is None
    with torch.no_grad():
        torch.testing.assert_close(logits(m, 3, input_ids=ids), m(input_ids=ids, logits_to_keep=3).logits)


def test_verification_forwards_take_the_suffix_attention_path(monkeypatch):
    # the CPU verification shortcut must really run (a mask it does not recognise would silently fall back to
    # the masked kernel), only in multi-token forwards, and greedy output stays equal to plain greedy
    import kvkit.stores.full

    calls = []
    real = kvkit.stores.full.causal_suffix_attention

    def spy(query, *args):
        out = real(query, *args)
        calls.append((query.shape[2], out is not None))
        return out

    monkeypatch.setattr(kvkit.stores.full, "causal_suffix_attention", spy)
    m = tiny_model("llama")
    ids = _prompt(90)
    ref, _, _ = greedy(m, ids, 12)
    out = generate(m, ids, draft_options={"budget": 16, "sink": 4}, gamma=3, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(out[0, 90:], ref[0])
    assert calls and all(ok and t > 1 for t, ok in calls)
