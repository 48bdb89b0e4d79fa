"""Greedy speculative output == plain greedy output on the default model, 10 long prompts.

python results/speculative/check_greedy.py > results/speculative/check_greedy.txt
"""

import time

import torch

from kvkit.demo import needle_prompt
from kvkit.models import load_default
from kvkit.speculative import SpeculativeStats, generate
from kvkit.testing import greedy

torch.manual_seed(0)
model, tok = load_default()
SETTINGS = [("streaming", {"budget": 256, "sink": 16}, 4), ("retrieval", {"budget": 256}, 4),
            ("streaming", {"budget": 128, "sink": 16}, 2), ("retrieval", {"budget": 128}, 6),
            ("streaming", {"budget": 512, "sink": 16}, 6)]
ok = 0
for i in range(10):
    policy, opts, gamma = SETTINGS[i % len(SETTINGS)]
    ids, _ = needle_prompt(tok, context_tokens=900 + 50 * i, depth=0.1 * i, seed=i)
    t = time.perf_counter()
    ref, _, _ = greedy(model, ids, 24)
    st = SpeculativeStats()
    out = generate(model, ids, draft_policy=policy, draft_options=opts, gamma=gamma, max_new_tokens=24,
                   eos_token_id=None, stats=st)
    same = torch.equal(out[0, ids.shape[1]:], ref[0])
    ok += same
    print(f"prompt {i}: {ids.shape[1]} tokens, {policy}{opts} gamma={gamma}: acceptance {st.acceptance_rate:.2f}, "
          f"identical={same} ({time.perf_counter() - t:.0f}s)", flush=True)
print(f"{ok}/10 prompts: speculative greedy output identical to plain greedy (24 new tokens each)")
