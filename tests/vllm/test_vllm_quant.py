"""kvkit's packed 4/8-bit KV pages in vLLM (policy ``quant:bits=4``; run in .venv-vllm: scripts/install_vllm.sh).

* the switch (no vLLM needed);
* one attention layer's write + forward on a mixed batch (decode rows, a prefill chunk over a cached context, a
  fresh prompt) against a torch reference, calling the backend's code directly (no engine);
* engines (each configuration in its own process through ``python -m kvkit.vllm.probe``, as in
  test_vllm_engine.py): capacity read back from the engine, greedy tokens / log-probs against vanilla vLLM on
  the tiny random Llama and on the default model, a needle at ~2.6K tokens on the default model.
"""

import importlib.util

import pytest
import torch

from kvkit.vllm import config as C
from kvkit.vllm.testing import greedy_deltas, probe_runner

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (.venv-vllm: scripts/install_vllm.sh)")


def test_switch():
    p = C.parse_policy("quant:bits=4")
    assert (p.name, p.bits) == ("quant", 4)
    assert C.parse_policy({"policy": "quant", "bits": 8}).bits == 8
    assert C.parse_policy("quant").bits == 4
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        C.parse_policy("quant:bits=2")


# --- one layer, no engine ----------------------------------------------------------------------------------------
@needs_vllm
@pytest.mark.parametrize("bits", [4, 8])
def test_layer_write_and_forward_match_reference(bits):
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

    from kvkit.kernels import paged_quant_cpu as PQ
    from kvkit.vllm import quant

    torch.manual_seed(0)
    H, G, D, bs = 2, 3, 64, 32
    isa = _get_attn_isa(torch.bfloat16, bs, D, "auto")
    if isa == "amx":
        torch.cpu._init_amx()  # the process asks the kernel for AMX state, as the engine's worker does
    pol = C.parse_policy(f"quant:bits={bits}")
    nblocks = 24
    cache = torch.zeros(nblocks, H, bs, PQ.state_bytes(D, bits, bs), dtype=torch.uint8)
    # rows: 0 decodes (70 cached + 1 new), 1 prefills a chunk of 25 after 40 cached, 2 a fresh prompt of 33
    ctx, qlen = [70, 40, 0], [1, 25, 33]
    seq = [c + q for c, q in zip(ctx, qlen)]
    perm = torch.randperm(nblocks)
    bt = torch.zeros(3, 4, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq):
        nb = -(-s // bs)
        bt[i, :nb] = perm[used: used + nb].to(torch.int32)
        used += nb
    K = [torch.randn(s, H, D) for s in seq]
    for k in K:
        k[..., 5] *= 6
    V = [torch.randn(s, H, D) for s in seq]
    slot = [bt[i].long()[torch.arange(s) // bs] * bs + torch.arange(s) % bs for i, s in enumerate(seq)]
    impl = SimpleNamespace(head_size=D, scale=D ** -0.5, alibi_slopes=None, sliding_window=-1, logits_soft_cap=0,
                           sinks=None, kvkit_policy=pol)
    layer = SimpleNamespace(isa=isa)
    for i in range(3):  # earlier steps cached the contexts
        if ctx[i]:
            quant.write(impl, layer, K[i][: ctx[i]].bfloat16(), V[i][: ctx[i]].bfloat16(), cache, slot[i][: ctx[i]])
    # this step: the new tokens of every row, in row order
    key = torch.cat([K[i][ctx[i]:] for i in range(3)]).bfloat16()
    value = torch.cat([V[i][ctx[i]:] for i in range(3)]).bfloat16()
    sm = torch.cat([slot[i][ctx[i]:] for i in range(3)])
    quant.write(impl, layer, key, value, cache, sm)
    T = key.shape[0]
    query = torch.randn(T, H * G, D).bfloat16()
    qsl = torch.tensor([0, 1, 26, 59], dtype=torch.int32)
    md = CPUAttentionMetadata(num_actual_tokens=T, max_query_len=33, query_start_loc=qsl, max_seq_len=max(seq),
                              seq_lens=torch.tensor(seq, dtype=torch.int32), block_table=bt, slot_mapping=sm,
                              scheduler_metadata=None)
    builder = SimpleNamespace(policy=pol, block_size=bs, num_heads=H * G, num_kv_heads=H, head_dim=D,
                              dtype=torch.bfloat16, isa=isa)
    plan = quant.build_plan(builder, md, 3)
    assert plan.record.decode_reqs == 1 and plan.dec_tok.tolist() == [0]
    out = torch.zeros(T, H * G, D, dtype=torch.bfloat16)
    quant.forward(impl, layer, query, key, value, cache, plan, out)

    # reference: decode row over its dequantised tokens; prefill rows: dequantised context + exact fresh K/V, causal
    ref = torch.zeros(T, H * G, D)
    ref[0] = PQ.decode_ref(query[:1], cache, bt[:1], torch.tensor(seq[:1]), bs, bits, impl.scale)[0]
    for i, (a, b) in ((1, (1, 26)), (2, (26, 59))):
        kc, vc = PQ.gather(cache, slot[i][: ctx[i]], bs, D, bits)
        k = torch.cat([kc.bfloat16().float(), K[i][ctx[i]:].bfloat16().float()])
        v = torch.cat([vc.bfloat16().float(), V[i][ctx[i]:].bfloat16().float()])
        q = query[a:b].float().view(-1, H, G, D)
        s = torch.einsum("thgd,lhd->thgl", q, k) * impl.scale
        pos = ctx[i] + torch.arange(b - a)
        s = s.masked_fill((torch.arange(seq[i])[None, :] > pos[:, None])[:, None, None, :], float("-inf"))
        ref[a:b] = torch.einsum("thgl,lhd->thgd", torch.softmax(s, -1), v).reshape(b - a, H * G, D)
    err = (out.float() - ref).abs().max().item()
    assert err < 0.03, err  # bf16 outputs; vLLM's kernel computes in bf16/fp32 mixes
    # and the fresh prompt (row 2) is exact attention over its exact K/V, as in vanilla vLLM
    k, v = K[2].bfloat16().float(), V[2].bfloat16().float()
    q = query[26:59].float().view(-1, H, G, D)
    s = torch.einsum("thgd,lhd->thgl", q, k) * impl.scale
    s = s.masked_fill(torch.triu(torch.ones(33, 33, dtype=torch.bool), 1)[:, None, None, :], float("-inf"))
    exact = torch.einsum("thgl,lhd->thgd", torch.softmax(s, -1), v).reshape(33, H * G, D)
    assert (out[26:59].float() - exact).abs().max().item() < 0.03


# --- engines -----------------------------------------------------------------------------------------------------
TINY_BLOCK = 32


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return probe_runner(tmp_path_factory.mktemp("vllm_quant_probe"), timeout=1200)


@needs_vllm
@pytest.mark.slow
def test_capacity_default_model(probe):
    """Tokens the engine's KV pool holds in the same VLLM_CPU_KVCACHE_SPACE (read back from the engine)."""
    van = probe("--model", "default", "--vanilla", "--kv-gib", "1")
    q4 = probe("--model", "default", "--policy", "quant:bits=4", "--kv-gib", "1")
    q8 = probe("--model", "default", "--policy", "quant:bits=8", "--kv-gib", "1")
    r4, r8 = q4["capacity_tokens"] / van["capacity_tokens"], q8["capacity_tokens"] / van["capacity_tokens"]
    print(f"\ncapacity tokens in 1 GiB: vanilla bf16 {van['capacity_tokens']}, kvkit 4-bit {q4['capacity_tokens']} "
          f"({r4:.3f}x), kvkit 8-bit {q8['capacity_tokens']} ({r8:.3f}x)")
    assert van["block_size"] == q4["block_size"] == q8["block_size"]
    assert r4 >= 3.5
    assert r8 >= 1.85


TINY_GEN = ("--model", "tiny:TINY", "--block-size", str(TINY_BLOCK), "--gen", "3,700,12")


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_greedy_close_tiny_model(probe, bits):
    van = probe(*TINY_GEN, "--vanilla")
    q = probe(*TINY_GEN, "--policy", f"quant:bits={bits}")
    assert q["capacity_tokens"] > 3 * van["capacity_tokens"] if bits == 4 else q["capacity_tokens"] > van["capacity_tokens"]
    g = q["gen"]
    assert g["decode_steps"] == 11  # the decode rows went through the packed path
    sames, deltas = [], []
    for i in range(3):
        same, d = greedy_deltas({"tokens": van["gen"]["tokens"][i], "logprobs": van["gen"]["logprobs"][i]},
                          {"tokens": g["tokens"][i], "logprobs": g["logprobs"][i]})
        sames.append(same)
        deltas += d
    print(f"\ntiny Llama {bits}-bit vs vanilla: identical leading tokens {sames} of 12, max |dlogprob| "
          f"{max(deltas):.4f}, mean {sum(deltas) / len(deltas):.4f}")
    assert min(sames) >= 1  # the first token comes from the (exact) prefill
    assert sum(d <= 1e-6 for d in deltas) < len(deltas)  # the packed decode does change the numbers
    assert max(deltas) < 0.5 and sum(deltas) / len(deltas) < 0.1


NEEDLE = ("--model", "default", "--needle", "2500,0.4", "--needle-tokens", "16")  # 2575-token prompt


@needs_vllm
@pytest.mark.slow
def test_needle_and_greedy_default_model(probe):
    van = probe(*NEEDLE, "--vanilla")
    assert van["needle"]["found"], van["needle"]
    q = probe(*NEEDLE, "--policy", "quant:bits=4")
    n = q["needle"]
    same, deltas = greedy_deltas(van["needle"], n)
    print(f"\ndefault model 4-bit pages vs vanilla: needle found={n['found']} ({n['answer'][:24]!r}), {same}/"
          f"{len(n['tokens'])} greedy tokens identical, max |dlogprob| {max(deltas):.4f}, "
          f"mean {sum(deltas) / len(deltas):.4f}")
    assert n["found"], n
    assert same >= 4  # the answer's leading tokens
    assert max(deltas) < 1.0
