"""Per-forward costs at 8K on CPU, interleaved so load drift hits every variant alike.

A plain one-token decode step; a gamma+1 verification forward three ways: transformers' own sdpa call
(repeats each K/V head before the masked kernel), kvkit's ``hf_sdpa`` (the same masked kernel with native
GQA, same bits), and kvkit's verification path (prefix + causal-suffix attention, tall lm_head); and a
retrieval-1024 draft step. 5 rounds; each round times every variant 3 times; the median over all 15 is printed.

Usage: .venv/bin/python benchmarks/speculative/profile_verify.py > results/speculative/profile_verify_cpu.txt
"""

import copy
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvkit
import kvkit.stores.full
from kvkit.compat import cache_kw
from kvkit.models import load
from kvkit.speculative.draft import DraftCache, make_view
from kvkit.speculative.forward import logits

torch.manual_seed(0)
torch.set_num_threads(2)
model, _ = load("default")
kvkit.patch(model, "full")
ids = torch.randint(100, 20000, (1, 8100))
base = kvkit.KVCache(model)
kvkit.prefill(model, ids, chunk_size=4096, cache=base)
cache = copy.deepcopy(base)
draft = DraftCache(base, make_view("retrieval", {"budget": 1024}))
draft.begin_round()


def transformers_sdpa(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)[0]


def forward(c, tokens: int, fast: bool, hf: bool = False) -> None:
    """A forward of ``tokens`` tokens; fast: kvkit.speculative's verification (``cache.verification()``: prefix +
    causal-suffix attention; the head applied as a tall-skinny product, kvkit.speculative.forward)."""
    x = torch.randint(100, 20000, (1, tokens))
    kvkit_sdpa = kvkit.stores.full.hf_sdpa
    if hf:
        kvkit.stores.full.hf_sdpa = transformers_sdpa
    try:
        with torch.no_grad():
            if fast:
                with c.verification():
                    logits(model, tokens, input_ids=x, **cache_kw(c))
            else:
                model(input_ids=x, **cache_kw(c), use_cache=True, logits_to_keep=tokens)
    finally:
        kvkit.stores.full.hf_sdpa = kvkit_sdpa
    for layer in c.layers:
        layer.crop(-tokens)


variants = {
    "plain step (1 token)": lambda: forward(cache, 1, False),
    "verify 5 tokens, transformers sdpa": lambda: forward(cache, 5, False, hf=True),
    "verify 5 tokens, masked GQA kernel": lambda: forward(cache, 5, False),
    "verify 5 tokens, kvkit path": lambda: forward(cache, 5, True),
    "verify 9 tokens, transformers sdpa": lambda: forward(cache, 9, False, hf=True),
    "verify 9 tokens, masked GQA kernel": lambda: forward(cache, 9, False),
    "verify 9 tokens, kvkit path": lambda: forward(cache, 9, True),
    "draft step, retrieval 1024": lambda: forward(draft, 1, False),
}
times = {name: [] for name in variants}
for fn in variants.values():
    fn()  # warm-up
for _ in range(5):
    for name, fn in variants.items():
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
plain = statistics.median(times["plain step (1 token)"])
print(f"SmolLM2-135M fp32, 8100-token cache, 2 threads; median of {len(times['plain step (1 token)'])} runs")
for name, ts in times.items():
    med = statistics.median(ts)
    print(f"{name:<34} {1e3 * med:7.1f} ms  {med / plain:5.2f} plain steps")
