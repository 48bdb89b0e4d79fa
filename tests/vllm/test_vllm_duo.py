"""DuoAttention in the vLLM plugin (``additional_config={"kvkit": "duo"}``; run in .venv-vllm: scripts/install_vllm.sh).

* the switch and the pattern errors (no engine);
* kvkit's page layouts == what vLLM's ``cpu_attn_reshape_and_cache`` writes (amx / vec / vec16), and the per-head
  kernel == vLLM's op on those pages when every head reads every block (no engine);
* engines, each configuration in its own process (``python -m kvkit.vllm.probe``, as in test_vllm_engine.py): a
  tiny random Llama with a pattern written here (blocks read per step == the formula, greedy close to vanilla;
  all heads retrieval == vanilla exactly; TP=2 == TP=1), the default model with its shipped pattern on a needle.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvkit.kernels import paged_heads_cpu as PH  # noqa: E402
from kvkit.vllm import config as C  # noqa: E402

TINY_BLOCK = 32
TINY_LAYERS, TINY_KV = 6, 2  # kvkit.vllm.testing.tiny_llama_dir's defaults (4 query heads, 2 KV heads, D=64)
# gates per layer and KV head; sparsity 0.5 makes the 6 lowest streaming heads: layer 2 all streaming, layer 3 all
# retrieval, the others mixed (the per-head kernel)
TINY_ALPHA = [[0.9, 0.1], [0.2, 0.8], [0.05, 0.03], [0.95, 0.97], [0.6, 0.4], [0.3, 0.7]]
TINY_RETRIEVAL = [[True, False], [False, True], [False, False], [True, True], [True, False], [False, True]]
SINK, RECENT = 32, 64


def test_switch(tmp_path):
    p = C.parse_policy("duo")
    assert (p.name, p.sink, p.recent, p.pattern, p.sparsity) == ("duo", 64, 256, None, None)  # the paper's deploy
    assert C.parse_policy("streaming").sink == 4  # the other policies keep their default
    one = _pattern(tmp_path, TINY_ALPHA, "p.json")  # a switch's pattern is read (and checked) when parsed
    p = C.parse_policy(f"duo:sink=32,recent=64,pattern={one},sparsity=0.25")
    assert (p.sink, p.recent, p.pattern, p.sparsity) == (32, 64, one, 0.25)
    two = _pattern(tmp_path, TINY_ALPHA, "a,b.json")  # a comma inside a dict switch's value is no separator
    assert C.parse_policy({"policy": "duo", "pattern": two}).pattern == two
    with pytest.raises(ValueError, match="sparsity must be"):
        C.parse_policy("duo:sparsity=1.5")
    with pytest.raises(ValueError, match="recent must be"):
        C.parse_policy("duo:recent=0")
    with pytest.raises(ValueError, match="the vLLM plugin does not run it yet"):
        C.parse_policy("cake")
    # a streaming head's window at block 128: sink block 0, then the blocks of the last 256 tokens
    p = C.parse_policy("duo")
    assert p.sink_blocks(128) == 1
    assert p.recent_start_block(4096 + 1, 128) == 30 and p.recent_start_block(4096, 128) == 30
    assert p.recent_start_block(300, 128) == 1  # within sink + recent: every block


def _fake_vllm_config(tmp_path, alpha=None, **cfg):
    from transformers import LlamaConfig

    hf = LlamaConfig(num_hidden_layers=cfg.get("layers", TINY_LAYERS), num_attention_heads=4,
                     num_key_value_heads=cfg.get("kv", TINY_KV), hidden_size=256, head_dim=64, vocab_size=512)
    mc = SimpleNamespace(hf_config=hf, hf_text_config=hf)
    return SimpleNamespace(model_config=mc)


def _pattern(tmp_path, alpha, name="pattern.json") -> str:
    path = Path(tmp_path) / name
    path.write_text(json.dumps({"format": "kvkit-duo-pattern", "alpha": alpha}))
    return str(path)


def test_pattern_errors_and_tp_slices(tmp_path, monkeypatch):
    from kvkit.vllm import backend as B

    cfg = _fake_vllm_config(tmp_path)
    monkeypatch.setattr(B, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(B, "get_tensor_model_parallel_rank", lambda: 0)
    with pytest.raises(ValueError, match="no DuoAttention pattern ships for this model"):
        B.duo_retrieval_heads(C.parse_policy("duo"), cfg, TINY_KV)
    bad = _pattern(tmp_path, [[0.5, 0.5, 0.5]] * 4, "bad.json")
    with pytest.raises(ValueError, match="has 4 layers x 3 KV heads, but this model .* has 6 layers x 2 KV heads"):
        B.duo_retrieval_heads(C.parse_policy(f"duo:pattern={bad}"), cfg, TINY_KV)
    pol = C.parse_policy(f"duo:pattern={_pattern(tmp_path, TINY_ALPHA)},sparsity=0.5")
    assert B.duo_retrieval_heads(pol, cfg, TINY_KV).tolist() == TINY_RETRIEVAL
    # TP=2: each rank holds one of the two KV heads, and gets that column of the pattern
    monkeypatch.setattr(B, "get_tensor_model_parallel_world_size", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(B, "get_tensor_model_parallel_rank", lambda r=rank: r)
        assert B.duo_retrieval_heads(pol, cfg, 1).tolist() == [[r[rank]] for r in TINY_RETRIEVAL]
    # TP=4 over 2 KV heads: vLLM replicates head r // 2 on rank r
    monkeypatch.setattr(B, "get_tensor_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(B, "get_tensor_model_parallel_rank", lambda: 3)
    assert B.duo_retrieval_heads(pol, cfg, 1).tolist() == [[r[1]] for r in TINY_RETRIEVAL]


# --- kvkit's page layouts and kernel against vLLM's own ops (no engine) -------------------------------------------
@pytest.mark.parametrize("isa", ["amx", "vec", "vec16"])
@pytest.mark.parametrize("D", [64, 128])
def test_layout_and_kernel_match_vllm_ops(isa, D):
    from vllm import _custom_ops as ops

    from kvkit.vllm.testing import vllm_decode_op

    if isa == "amx":
        if not torch.cpu._is_amx_tile_supported():
            pytest.skip("no AMX on this machine")
        torch.cpu._init_amx()
    layout = PH.layout_for_isa(isa)
    H, G, bs, n = 3, 3, 128, 3
    seqs = [130, 700, 1024]
    nbs = [-(-s // bs) for s in seqs]
    NB = sum(nbs) + 3
    g = torch.Generator().manual_seed(D)
    perm = torch.randperm(NB, generator=g)
    bt = torch.zeros(n, max(nbs), dtype=torch.int32)
    ours, theirs = torch.zeros(NB, H, bs, 2 * D, dtype=torch.bfloat16), torch.zeros(NB, H, bs, 2 * D, dtype=torch.bfloat16)
    kc, vc = PH.split_cache(theirs)
    kc2, vc2 = PH.split_cache(ours)
    used = 0
    for i, (s, nb) in enumerate(zip(seqs, nbs)):
        bt[i, :nb] = perm[used: used + nb].to(torch.int32)
        used += nb
        k, v = torch.randn(s, H, D, generator=g).bfloat16(), torch.randn(s, H, D, generator=g).bfloat16()
        pos = torch.arange(s)
        slots = bt[i].long()[pos // bs] * bs + pos % bs
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
        PH.write(kc2, vc2, k, v, slots, layout)
    assert torch.equal(ours, theirs)
    q = torch.randn(n, H * G, D, generator=g).bfloat16()
    seq = torch.tensor(seqs, dtype=torch.int32)
    out = vllm_decode_op(q, kc, vc, bt, seq, isa)()
    blocks = bt.unsqueeze(1).expand(n, H, bt.shape[1]).contiguous()
    ntok = seq.unsqueeze(1).expand(n, H).contiguous()
    mine = PH.decode(q, kc, vc, blocks, ntok, D ** -0.5, layout)
    ref = PH.decode_ref(q, kc, vc, blocks, ntok, D ** -0.5, layout)
    torch.testing.assert_close(mine, ref, atol=2e-5, rtol=1e-4)
    # vLLM's output is bf16 (its rounding: up to 2^-9 relative); its AMX path also rounds the probabilities to bf16
    # before P.V; its vec path agrees with the fp32 kernel to the output's rounding
    err = ((out.float() - mine).abs().max() / mine.abs().max()).item()
    assert err < 1e-2, err
    if isa != "amx":
        assert (out.float() - mine.bfloat16().float()).abs().max() <= 2 * 2 ** -8 * mine.abs().max()


# --- engines -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_duo_probe")
    tiny = root / "tiny-llama"
    cache: dict = {}

    def run(*args: str, env_extra: dict | None = None) -> dict:
        key = tuple(a.replace("TINY", str(tiny)).replace("ROOT", str(root)) for a in args)
        ck = key + tuple(sorted((env_extra or {}).items()))
        if ck not in cache:
            out = root / f"r{len(cache)}.json"
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env_extra or {}))
            env.pop("KVKIT_VLLM_POLICY", None)
            p = subprocess.run([sys.executable, "-m", "kvkit.vllm.probe", "--out", str(out), *key],
                               env=env, capture_output=True, text=True, timeout=900)
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
            cache[ck] = json.loads(out.read_text())
        return cache[ck]

    run.root = root
    _pattern(root, TINY_ALPHA, "tiny_mixed.json")
    _pattern(root, [[1.0, 1.0]] * TINY_LAYERS, "tiny_retrieval.json")
    return run


TINY_GEN = ("--model", "tiny:TINY", "--block-size", str(TINY_BLOCK), "--gen", "3,700,12")
TINY_DUO = f"duo:sink={SINK},recent={RECENT},pattern=ROOT/tiny_mixed.json,sparsity=0.5"


def _same_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.slow
def test_tiny_blocks_read_per_step_and_close_to_vanilla(probe):
    van = probe(*TINY_GEN, "--vanilla")
    r = probe(*TINY_GEN, "--policy", TINY_DUO)
    g, bs = r["gen"], r["block_size"]
    assert bs == TINY_BLOCK and g["decode_steps"] == 11
    S = math.ceil(SINK / bs)
    for step, (read, full) in enumerate(zip(g["blocks_read"], g["blocks_full"])):
        ctx = [n + 1 + step for n in g["prompt_lens"]]  # tokens seen by this step's query
        nb = [math.ceil(c / bs) for c in ctx]
        stream = [S + b - max(S, (c - RECENT) // bs) for c, b in zip(ctx, nb)]  # sink block + recent window
        heads = sum(sum(nb) if ret else sum(stream) for layer in TINY_RETRIEVAL for ret in layer)
        assert full == TINY_LAYERS * sum(nb)
        assert read * TINY_KV == heads, (step, read, heads)  # blocks_read: the mean over the KV heads
    assert max(g["blocks_read"]) < 0.65 * min(g["blocks_full"])  # half the heads read 4 of ~23 blocks
    sames, deltas = [], []
    for i in range(3):
        same = _same_prefix(van["gen"]["tokens"][i], g["tokens"][i])
        sames.append(same)
        deltas += [abs(a - b) for a, b in zip(van["gen"]["logprobs"][i][:same], g["logprobs"][i][:same])]
    print(f"\ntiny Llama duo (6 of 12 KV heads streaming, {SINK}+{RECENT} tokens) vs vanilla: identical leading "
          f"tokens {sames} of 12, max |dlogprob| {max(deltas):.4f}")
    assert min(sames) >= 1  # the first token comes from the exact prefill
    assert max(deltas) < 0.5


@pytest.mark.slow
def test_tiny_all_retrieval_equals_vanilla(probe):
    """Every head a retrieval head: every layer runs vLLM's op on the full tables (bit-identical to vanilla); with
    KVKIT_VLLM_DUO_KERNEL=always the per-head kernel runs them instead (exact attention in fp32, vLLM's AMX op
    rounds probabilities to bf16: close, not bit-identical; the random tiny model's near-tied logits can flip a
    greedy token, so only the tokens before the first difference are compared)."""
    van = probe(*TINY_GEN, "--vanilla")
    pol = f"duo:sink={SINK},recent={RECENT},pattern=ROOT/tiny_retrieval.json,sparsity=0"
    r = probe(*TINY_GEN, "--policy", pol)
    assert r["gen"]["tokens"] == van["gen"]["tokens"]
    assert r["gen"]["logprobs"] == van["gen"]["logprobs"]
    assert r["gen"]["blocks_read"] == r["gen"]["blocks_full"]
    k = probe(*TINY_GEN, "--policy", pol, env_extra={"KVKIT_VLLM_DUO_KERNEL": "always"})["gen"]
    deltas, sames = [], []
    for i in range(3):
        same = _same_prefix(van["gen"]["tokens"][i], k["tokens"][i])
        sames.append(same)
        deltas += [abs(a - b) for a, b in zip(van["gen"]["logprobs"][i][:same], k["logprobs"][i][:same])]
    print(f"\ntiny Llama, per-head kernel on every layer, all heads retrieval, vs vanilla: identical leading tokens "
          f"{sames} of 12, max |dlogprob| {max(deltas):.4f}")
    assert min(sames) >= 1 and sum(sames) >= 18 and max(deltas) < 0.2


@pytest.mark.slow
def test_tiny_tp2_equals_tp1(probe):
    args = ("--model", "tiny:TINY", "--block-size", str(TINY_BLOCK), "--gen", "2,500,8", "--policy", TINY_DUO)
    one = probe(*args)
    two = probe(*args, "--tp", "2")
    assert two["gen"]["tokens"] == one["gen"]["tokens"]


# --- the bundled default model (SmolLM2-135M-Instruct, 30 layers x 3 KV heads) with its shipped pattern -----------
NEEDLE = ("--model", "default", "--needle", "2500,0.5", "--needle-tokens", "16")  # ~2575-token prompt, 21 blocks


@pytest.mark.slow
def test_needle_default_model_shipped_pattern(probe):
    van = probe(*NEEDLE, "--vanilla")
    assert van["needle"]["found"], van["needle"]
    r = probe(*NEEDLE, "--policy", "duo")  # shipped pattern, sparsity 0.5, sink 64, recent 256
    n = r["needle"]
    same = _same_prefix(van["needle"]["tokens"], n["tokens"])
    deltas = [abs(a - b) for a, b in zip(van["needle"]["logprobs"][:same], n["logprobs"][:same])]
    print(f"\ndefault model duo (shipped pattern) vs vanilla: needle found={n['found']} ({n['answer'][:24]!r}), "
          f"{same}/{len(n['tokens'])} greedy tokens identical, |dlogprob| over them "
          f"{[round(d, 3) for d in deltas]}, read fraction {n['read_fraction'][:1]}")
    # 45 of 90 KV heads stream: at 2575 tokens (21 blocks of 128) they read 1 sink + 3 recent blocks
    assert all(0.55 < f < 0.65 for f in n["read_fraction"]), n["read_fraction"]
    assert same >= 4
    assert n["found"], n
