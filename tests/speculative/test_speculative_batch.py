"""kvkit.speculative at batch > 1; compressing targets and drafts near the context end.

Every row of a left-padded batch accepts its own drafts; the output must be plain batched greedy's row by row.
"""

import copy
import math

import pytest
import torch

import kvkit
from kvkit.patch import is_patched
from kvkit.speculative import SpeculativeStats, generate
from kvkit.speculative.rows import Rows
from kvkit.testing import greedy, left_padded_batch, tiny_model

VIEWS = {"streaming": {"budget": 20, "sink": 4}, "retrieval": {"budget": 24, "chunk": 8}}
LENGTHS = [90, 61, 75, 40]  # rows of different lengths: three of them left padded


@pytest.fixture
def accepted_counts(monkeypatch):
    """The per-row accepted counts of every round (to check rows really accepted different numbers)."""
    rounds = []
    commit = Rows.commit

    def spy(self, cache, drafts, n, nxt):
        rounds.append(n.tolist())
        commit(self, cache, drafts, n, nxt)

    monkeypatch.setattr(Rows, "commit", spy)
    return rounds


@pytest.mark.parametrize(
    "arch,overrides,policy,gammas",
    [("llama", {}, "streaming", (1, 4)), ("llama", {}, "retrieval", (2, 6)),
     ("qwen2", {}, "streaming", (3, 5)), ("qwen2", {}, "retrieval", (1, 4)),
     ("mistral", {"sliding_window": 48}, "streaming", (2, 6)), ("mistral", {}, "retrieval", (3,)),
     ("gemma3_text", {"sliding_window": 32}, "streaming", (3,))],
)
def test_batched_greedy_equals_plain_batched_greedy(arch, overrides, policy, gammas, accepted_counts):
    m = tiny_model(arch, **overrides)
    ids, mask, _ = left_padded_batch(LENGTHS, seed=1)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    for gamma in gammas:
        accepted_counts.clear()
        st = SpeculativeStats()
        out = generate(m, ids, attention_mask=mask, draft_policy=policy, draft_options=VIEWS[policy], gamma=gamma,
                       max_new_tokens=16, eos_token_id=None, stats=st)
        for b in range(len(LENGTHS)):
            assert torch.equal(out[b], ref[b]), (arch, policy, gamma, b)
        assert st.new_tokens == 16 * len(LENGTHS) and st.drafted >= st.accepted
        if gamma > 1 and arch != "mistral" or overrides:  # (a 24-token window is read whole by the draft: exact)
            assert any(len(set(n)) > 1 for n in accepted_counts), "rows never accepted different counts: no holes"
    assert not is_patched(m)


@pytest.mark.parametrize("policy", ["streaming", "retrieval"])
def test_batched_greedy_with_eos_in_some_rows(policy, monkeypatch):
    m = tiny_model("llama")
    ids, mask, _ = left_padded_batch([70, 50, 64, 33, 58], seed=2)
    free = m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)[:, 70:]
    # an EOS token that row 0 emits early and some rows never emit
    counts = [[int((r == t).any()) for r in free] for t in free[0, 2:8].tolist()]
    eos = free[0, 2:8].tolist()[min(range(len(counts)), key=lambda i: sum(counts[i]))]
    assert 1 <= sum(int((r == eos).any()) for r in free) < len(free)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    sizes = []
    retire = Rows.retire

    def spy(self, caches, tokens_per_round):
        retire(self, caches, tokens_per_round)
        sizes.append(self.size)

    monkeypatch.setattr(Rows, "retire", spy)
    for gamma in (2, 5):
        sizes.clear()
        out = generate(m, ids, attention_mask=mask, draft_policy=policy, draft_options=VIEWS[policy], gamma=gamma,
                       max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), (policy, gamma)
        assert min(sizes) < len(free)  # the finished rows left the batch


def test_hf_custom_generate_at_batch():
    m = tiny_model("qwen2")
    ids, mask, _ = left_padded_batch([50, 35, 44], seed=3)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = m.generate(ids, attention_mask=mask, custom_generate=generate, gamma=3, max_new_tokens=12, do_sample=False,
                     pad_token_id=0)
    assert torch.equal(out, ref)


def test_batch_from_a_prefilled_cache_and_same_length_rows():
    # rows of equal length (no padding) continuing a prefilled cache, as `kvkit speculate --batch` runs them
    m = tiny_model("llama")
    ids = torch.randint(3, 128, (3, 80), generator=torch.Generator().manual_seed(4))
    ref = m.generate(ids, max_new_tokens=14, do_sample=False, pad_token_id=0)
    kvkit.patch(m, "full")
    try:
        base = kvkit.speculative.batch_cache(m)
        with torch.no_grad():
            m(input_ids=ids[:, :-1], past_key_values=base, use_cache=True)
        st = SpeculativeStats()
        out = generate(m, ids, past_key_values=copy.deepcopy(base), gamma=4, max_new_tokens=14, eos_token_id=None,
                       draft_options=VIEWS["streaming"], stats=st, return_dict_in_generate=True)
    finally:
        kvkit.unpatch(m)
    assert torch.equal(out.sequences, ref)
    assert out.past_key_values is None and 0 < st.acceptance_rate < 1 and st.tokens_per_round > 1


def test_batch_refuses_a_sliding_or_compressing_target_cache():
    m = tiny_model("mistral")
    ids, mask, _ = left_padded_batch([30, 20], seed=5)
    kvkit.patch(m, "full")
    try:
        with pytest.raises(ValueError, match="batch_cache"):
            generate(m, ids, attention_mask=mask, past_key_values=kvkit.KVCache(m), max_new_tokens=4)
    finally:
        kvkit.unpatch(m)
    m = tiny_model("llama")
    kvkit.patch(m, "streaming", budget=16, sink=4)
    try:
        with pytest.raises(ValueError, match="FullStore"):
            generate(m, ids, attention_mask=mask, max_new_tokens=4)
    finally:
        kvkit.unpatch(m)


# ---- the hierarchy at batch: a tiny assistant drafts for the self-draft ---------------------------------------------
@pytest.mark.parametrize(
    "arch,policy,gamma,assistant_gamma,acache",
    [("llama", "streaming", 4, 2, {"policy": "streaming", "budget": 24, "sink": 4}),
     ("llama", "retrieval", 6, 3, {"policy": "streaming", "budget": 16, "sink": 2}),
     ("qwen2", "streaming", 3, 1, {"policy": "full"}),
     ("mistral", "streaming", 5, 4, {"policy": "streaming", "budget": 20, "sink": 4})],
)
def test_batched_hierarchy_equals_plain_batched_greedy(arch, policy, gamma, assistant_gamma, acache, monkeypatch):
    """Rows of different lengths; the assistant's cache compacts past its budget (rows keep their own windows);
    every level accepts per row; the output is plain batched greedy's, row by row."""
    from kvkit.speculative.hierarchy import Assistant

    m = tiny_model(arch, **({"sliding_window": 40} if arch == "mistral" else {}))
    small = tiny_model(arch, seed=5, num_hidden_layers=1)
    ids, mask, _ = left_padded_batch(LENGTHS, seed=6)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    widths = []
    compact = Assistant.compact

    def spy(self):
        before = self.pos.shape[1]
        compact(self)
        widths.append((before, self.pos.shape[1]))

    monkeypatch.setattr(Assistant, "compact", spy)
    st = SpeculativeStats()
    out = generate(m, ids, attention_mask=mask, gamma=gamma, assistant=small, assistant_gamma=assistant_gamma,
                   draft_policy=policy, draft_options=VIEWS[policy], assistant_cache=acache, max_new_tokens=30,
                   eos_token_id=None, stats=st)
    for b in range(len(LENGTHS)):
        assert torch.equal(out[b], ref[b]), (arch, b)
    assert st.new_tokens == 30 * len(LENGTHS)
    assert 0 < st.assistant_accepted < st.assistant_drafted  # the assistant level really accepts and rejects
    if acache["policy"] == "streaming":  # compacted to at most the budget, after the prompt and while decoding
        shrunk = [(a, b) for a, b in widths if b < a]
        assert len(shrunk) >= 2 and all(b <= acache["budget"] for _, b in shrunk)
    assert not is_patched(small) and not is_patched(m)


def test_batched_hierarchy_levels_feed_exactly():
    """The assistant is a copy of the target with a full cache and the self-draft reads everything: every level then
    computes plain greedy's tokens, so every draft must be accepted at both levels. Any slip in the per-row
    bookkeeping (a filler or a hole read, a position off by one, a catch-up token missed) shows as a rejection."""
    m = tiny_model("llama")
    ids, mask, _ = left_padded_batch(LENGTHS, seed=9)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    st = SpeculativeStats()
    out = generate(m, ids, attention_mask=mask, gamma=5, assistant=copy.deepcopy(m), assistant_gamma=2,
                   draft_options={"budget": 512, "sink": 4}, assistant_cache={"policy": "full"}, max_new_tokens=24,
                   eos_token_id=None, stats=st)
    assert torch.equal(out, ref)
    assert st.assistant_drafted > 0 and st.assistant_acceptance_rate == 1.0 and st.acceptance_rate == 1.0
    # a noisy copy as the assistant: the middle level rejects some of its drafts (holes in the middle's tail, rows
    # apart), yet it still computes plain greedy's tokens, so the target accepts all of them
    noisy = copy.deepcopy(m)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.std())
    st = SpeculativeStats()
    out = generate(m, ids, attention_mask=mask, gamma=5, assistant=noisy, assistant_gamma=3,
                   draft_options={"budget": 512, "sink": 4}, max_new_tokens=24, eos_token_id=None, stats=st)
    assert torch.equal(out, ref)
    assert 0.2 < st.assistant_acceptance_rate < 0.9 and st.acceptance_rate == 1.0


def test_batched_hierarchy_with_eos_and_rows_leaving():
    m = tiny_model("llama")
    small = tiny_model("llama", seed=5, num_hidden_layers=1)
    ids, mask, _ = left_padded_batch([70, 50, 64, 33, 58], seed=2)
    free = m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)[:, 70:]
    counts = [[int((r == t).any()) for r in free] for t in free[0, 2:8].tolist()]
    eos = free[0, 2:8].tolist()[min(range(len(counts)), key=lambda i: sum(counts[i]))]
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = generate(m, ids, attention_mask=mask, gamma=4, assistant=small, assistant_gamma=2,
                   draft_options=VIEWS["streaming"], assistant_cache={"budget": 16, "sink": 4}, max_new_tokens=40,
                   eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


def test_batched_hierarchy_sampling_follows_target_distribution():
    """Chi-square at batch 8 with the assistant under the self-draft: both levels use the rejection rule."""
    m = tiny_model("llama", vocab_size=5, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    small = tiny_model("llama", vocab_size=5, num_hidden_layers=1, hidden_size=16, intermediate_size=32, seed=7)
    with torch.no_grad():
        m.lm_head.weight.mul_(40)
        small.lm_head.weight.mul_(20)
    counts, laws, st = _sampled_at_batch(m, assistant=small, assistant_gamma=2, assistant_cache={"budget": 6, "sink": 1})
    assert 0.05 < st.acceptance_rate < 0.97 and 0.05 < st.assistant_acceptance_rate < 0.97
    for i in range(2):
        assert _chi2_pvalue(counts[i], laws[i]) > 1e-3, i


def _ulp_bf16(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def test_bf16_batched_differs_from_plain_only_at_near_ties():
    """bf16: a (k + 1)-token verification rounds differently from a one-token step, so outputs may part where plain
    greedy's top-2 logits are within 2 ulp; find each row's first divergence and check its gap."""
    checked, diverged = 0, 0
    for arch, seed in (("llama", 0), ("qwen2", 1), ("llama", 2)):
        m = tiny_model(arch, seed=seed).to(torch.bfloat16)
        ids, mask, _ = left_padded_batch([80, 57, 66, 40], seed=seed)
        ref = m.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
        plain = ref.sequences[:, ids.shape[1]:]
        for policy in ("streaming", "retrieval"):
            out = generate(m, ids, attention_mask=mask, draft_policy=policy, draft_options=VIEWS[policy], gamma=4,
                           max_new_tokens=24, eos_token_id=None)[:, ids.shape[1]:]
            for b in range(ids.shape[0]):
                checked += 1
                diff = (out[b] != plain[b]).nonzero()
                if not diff.numel():
                    continue
                diverged += 1
                j = int(diff[0, 0])
                top = ref.logits[j][b].float().topk(2).values
                gap = float(top[0] - top[1])
                assert gap <= 2 * _ulp_bf16(float(top[0])), (arch, policy, b, j, gap)
    assert checked == 24 and diverged < checked  # most rows identical; the others part at near-ties only


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


def _joint_law(m, prompt, V, temp):
    """The target's exact law of (2nd, 3rd) sampled token after ``prompt [T]``: sum over the 1st."""
    with torch.no_grad():
        x0 = prompt[None]
        p1 = (m(x0).logits[0, -1] / temp).softmax(-1)
        joint = torch.zeros(V, V, dtype=torch.float64)
        for a in range(V):
            x = torch.cat([x0, torch.tensor([[a]])], 1)
            p2 = (m(x).logits[0, -1] / temp).softmax(-1)
            for b in range(V):
                p3 = (m(torch.cat([x, torch.tensor([[b]])], 1)).logits[0, -1] / temp).softmax(-1)
                joint[b] += p1[a].double() * p2[b].double() * p3.double()
    return joint.flatten()


def _sampled_at_batch(m, temp=0.8, **kwargs):
    """Batch 8 whose rows alternate two prompts of different lengths (one left padded), sampled 40 times with
    ``kwargs``: the counts of each row's (2nd, 3rd) tokens per prompt ``[2, V * V]``, the target's laws, the stats."""
    V = m.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (20,), generator=g), torch.randint(1, V, (16,), generator=g)]
    ids = torch.zeros(8, 20, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b in range(8):
        p = prompts[b % 2]
        ids[b, 20 - len(p) :], mask[b, 20 - len(p) :] = p, 1
    laws = [_joint_law(m, p, V, temp) for p in prompts]
    torch.manual_seed(0)
    counts = torch.zeros(2, V * V, dtype=torch.float64)
    st = SpeculativeStats()
    for _ in range(40):
        out = generate(m, ids, attention_mask=mask, gamma=2, draft_options={"budget": 3, "sink": 1}, max_new_tokens=4,
                       do_sample=True, temperature=temp, top_k=None, top_p=None, eos_token_id=None, stats=st, **kwargs)
        for b in range(8):
            counts[b % 2, out[b, 21] * V + out[b, 22]] += 1
    return counts, laws, st


def test_sampling_at_batch_follows_target_distribution():
    """Chi-square at batch 8 (fixed seed): rows alternate two prompts of different lengths (one left padded); the joint
    law of each row's 2nd and 3rd sampled tokens is the target's for its prompt."""
    m = tiny_model("llama", vocab_size=5, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # a peaked, prompt-dependent target (the random init is near uniform)
    counts, laws, st = _sampled_at_batch(m)
    assert 0.05 < st.acceptance_rate < 0.97  # rejections (and residual sampling) really happen
    for i in range(2):
        assert _chi2_pvalue(counts[i], laws[i]) > 1e-3, i


# ---- compressing targets, the context end ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len,new,gamma", [(500, 12, 4), (480, 30, 8)])
def test_drafts_capped_near_the_context_end(prompt_len, new, gamma):
    """A 512-position model: a request plain generate accepts (prompt + new <= 512) is accepted, and lossless."""
    m = tiny_model("llama", max_position_embeddings=512)
    ids = torch.randint(3, 128, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    ref, _, _ = greedy(m, ids, new)
    out = generate(m, ids, gamma=gamma, draft_options=VIEWS["streaming"], max_new_tokens=new, eos_token_id=None)
    assert torch.equal(out[0, prompt_len:], ref[0])


def test_drafts_capped_near_the_context_end_at_batch():
    m = tiny_model("llama", max_position_embeddings=512)
    ids, mask, _ = left_padded_batch([500, 470, 488], seed=8)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = generate(m, ids, attention_mask=mask, gamma=4, draft_options=VIEWS["streaming"], max_new_tokens=12,
                   eos_token_id=None)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("policy,options", [("cake", {"budget": 48, "window": 8}), ("zipcache", {"requant_interval": 8})])
def test_speculation_over_cake_or_zipcache_target_is_refused(policy, options):
    """Speculation over these targets differs from the patched model's own greedy output: refused, with the reason."""
    m = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(3))
    kvkit.patch(m, policy, **options)
    try:
        with pytest.raises(ValueError, match=f"{policy}.*not lossless"):
            generate(m, ids, gamma=4, max_new_tokens=40, eos_token_id=None)
        with pytest.raises(ValueError, match="not lossless"):
            m.generate(ids, custom_generate=generate, max_new_tokens=8, do_sample=False)
        assert kvkit.patched_policy(m).name == policy  # the user's patch is left in place
    finally:
        kvkit.unpatch(m)


def test_compressing_targets_that_stay_lossless():
    # the refusal is specific: speculation over a streaming or tidal target equals that target's own greedy output
    m = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(3))
    for policy, options in (("streaming", {"budget": 32, "sink": 4}), ("tidal", {})):
        kvkit.patch(m, policy, **options)
        try:
            ref = m.generate(ids, max_new_tokens=30, do_sample=False)
            out = generate(m, ids, gamma=4, max_new_tokens=30, eos_token_id=None)
        finally:
            kvkit.unpatch(m)
        assert torch.equal(out, ref), policy


@pytest.mark.parametrize("task", ["needle", "continue"])
def test_speculate_cli_batch(tmp_path, task, tiny_dir):
    # `kvkit speculate --batch 3`: plain batched greedy (kvkit full and transformers' DynamicCache) and the settings
    # decode the same tokens in every row (exit status 0); needle rows differ in length (left padded)
    import json

    from kvkit.cli import main

    d = tiny_dir
    out = tmp_path / "spec.jsonl"
    assert main(["speculate", "--model", str(d), "--task", task, "--batch", "3", "--length", "200", "--new-tokens", "8",
                 "--gamma", "3", "--draft-policy", "streaming,retrieval", "--budget", "64", "--baselines", "dynamic",
                 "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [3] * 4 and all(r["same"] for r in rows)
    assert rows[2]["draft_step_vs_plain"] > 0 and rows[3]["verify_vs_plain"] > 0
