"""CPU smoke of a compressing policy on the default model: one 2K needle prompt, a few settings.

    python benchmarks/smoke_2k.py zipcache '{}' '{"high_bits": 8, "low_bits": 8}' ...
    python benchmarks/smoke_2k.py chelsea '{"ratio": 0.5}' '{"ratio": 0.5, "size_bias": false}' ...

For each setting: KV bytes after prefill vs full, the greedy answer (12 tokens), and the top-1
agreement with full attention when teacher-forcing full's 12 answer tokens. One prompt: a fidelity
smoke test, not an accuracy number (RULER is).
"""

import json
import sys

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.demo import needle_prompt
from kvkit.models import load_default

STEPS = 12


@torch.no_grad()
def run(model, tok, ids, policy, opts):
    kvkit.patch(model, policy, **opts)
    try:
        cache = kvkit.KVCache(model)
        out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
        nbytes = cache.nbytes()
        toks, nxt = [], out.logits[:, -1].argmax(-1, keepdim=True)
        first = out.logits[:, -1]
        for _ in range(STEPS):
            toks.append(int(nxt))
            out = model(input_ids=nxt, **cache_kw(cache), use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return nbytes, toks, first
    finally:
        kvkit.unpatch(model)


@torch.no_grad()
def forced(model, ids, policy, opts, ref_toks):
    """Top-1 agreement with full's tokens when feeding them (one prompt prefill + one step per token)."""
    kvkit.patch(model, policy, **opts)
    try:
        cache = kvkit.KVCache(model)
        out = model(input_ids=ids, **cache_kw(cache), use_cache=True)
        agree = [int(out.logits[0, -1].argmax()) == ref_toks[0]]
        for i in range(len(ref_toks) - 1):
            out = model(input_ids=torch.tensor([[ref_toks[i]]]), **cache_kw(cache), use_cache=True)
            agree.append(int(out.logits[0, -1].argmax()) == ref_toks[i + 1])
        return sum(agree) / len(agree)
    finally:
        kvkit.unpatch(model)


def main():
    torch.manual_seed(0)
    policy, settings = sys.argv[1], [json.loads(s) for s in sys.argv[2:]] or [{}]
    model, tok = load_default()
    ids, value = needle_prompt(tok, context_tokens=2000, depth=0.5)
    full_bytes, ref, _ = run(model, tok, ids, "full", {})
    print(f"prompt {ids.shape[1]} tokens, needle {value}; full: {full_bytes} bytes, answer {tok.decode(ref)!r}")
    print("| policy | options | KV bytes after prefill | vs full | top-1 agree (12 forced) | greedy answer |")
    print("|---|---|---|---|---|---|")
    for opts in settings:
        nbytes, toks, _ = run(model, tok, ids, policy, opts)
        agree = forced(model, ids, policy, opts, ref)
        ans = tok.decode(toks).replace("\n", " ")
        print(f"| {policy} | {json.dumps(opts)} | {nbytes} | {full_bytes / nbytes:.2f}x | {agree:.2f} | {ans!r} |",
              flush=True)


if __name__ == "__main__":
    main()
