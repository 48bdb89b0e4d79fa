"""Greedy identity on long real prompts: speculative output == plain greedy output, token for token.

Used by ``benchmarks/speculative/check_greedy.py`` and the slow test on the bundled model. Each prompt
is prefilled once (the prompt minus its last token, ``full`` KV); plain greedy decoding and every
speculative setting continue from their own copy of that cache, as in ``kvkit speculate``. On a
mismatch the result records where the outputs first differ and the plain step's top-1 minus top-2
logit gap there: a gap near 0 is a numerical near-tie (multi-token verification and one-token
decoding round differently, which matters in bf16), a large gap is a real bug.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.demo import essay_text, needle_prompt
from kvkit.patch import is_patched
from kvkit.speculative.generate import SpeculativeStats, generate

#: (draft policy, draft options, gamma), cycled over the prompts. Even prompts are needle questions,
#: where a streaming window misses the needle (its drafts are mostly rejected), so retrieval drafts them;
#: odd prompts are essay continuations, drafted by streaming windows. Every setting still rejects some drafts.
SETTINGS = (
    ("retrieval", {"budget": 256}, 4),
    ("streaming", {"budget": 256, "sink": 16}, 4),
    ("retrieval", {"budget": 128}, 6),
    ("streaming", {"budget": 128, "sink": 16}, 2),
    ("retrieval", {"budget": 512, "rebuild": 4}, 3),
    ("streaming", {"budget": 512, "sink": 16}, 6),
)


@dataclass
class GreedyCheck:
    prompt: int
    kind: str  # "needle" or "continue"
    prompt_tokens: int
    setting: str
    identical: bool
    acceptance: float
    first_mismatch: int | None  # index of the first differing new token
    margin: float | None  # plain top-1 minus top-2 logit at that step
    seconds: float


def prompt_lengths(n: int, min_length: int, max_length: int) -> list[int]:
    """``n`` context lengths spread evenly over ``[min_length, max_length]``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of prompts must be an integer >= 1, got {n!r}")
    if min_length < 16 or max_length < min_length:
        raise ValueError(f"need 16 <= min_length <= max_length, got {min_length} and {max_length}")
    if n == 1:
        return [min_length]
    return [min_length + round(i * (max_length - min_length) / (n - 1)) for i in range(n)]


def make_prompt(tokenizer, i: int, length: int) -> tuple[str, torch.Tensor]:
    """Prompt ``i``: even -> a needle question (depth and value vary), odd -> raw essay text from an offset."""
    if i % 2 == 0:
        depth = (0.1 + 0.17 * i) % 1.0
        ids, _ = needle_prompt(tokenizer, context_tokens=length, depth=depth, seed=i)
        extra = ids.shape[1] - length  # chat template + needle + question
        if 0 < extra < length:
            ids, _ = needle_prompt(tokenizer, context_tokens=length - extra, depth=depth, seed=i)
        return "needle", ids
    text = tokenizer(essay_text(), add_special_tokens=False)["input_ids"]
    if len(text) < length:
        raise ValueError(f"the essay text has {len(text)} tokens, fewer than the {length} asked for")
    start = (i * 7919) % max(1, len(text) - length)
    return "continue", torch.tensor([text[start : start + length]])


@torch.no_grad()
def plain_greedy(model, cache, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decoding continuing ``cache`` (which holds ``ids[:, :-1]``): (tokens, top-1 minus top-2 logit per step)."""
    toks, margins = [], []
    nxt = ids[:, -1:]
    for _ in range(new_tokens):
        logits = model(input_ids=nxt, **cache_kw(cache), use_cache=True).logits[0, -1].float()
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        nxt = logits.argmax().view(1, 1).to(ids.device)
        toks.append(int(nxt))
    return toks, margins


@torch.no_grad()
def check_prompt(model, ids: torch.Tensor, new_tokens: int, settings, prompt: int = 0, kind: str = "") -> list[GreedyCheck]:
    """Plain vs speculative greedy on one prompt ``ids [1, n]`` (on the model's device), one result per setting."""
    patched_here = not is_patched(model)
    if patched_here:
        kvkit.patch(model, "full")
    try:
        base = kvkit.KVCache(model, prompt_length=min(ids.shape[1] - 1, 4096))
        kvkit.prefill(model, ids[:, :-1], chunk_size=4096, cache=base)
        plain, margins = plain_greedy(model, copy.deepcopy(base), ids, new_tokens)
        results = []
        for policy, opts, gamma in settings:
            t = time.perf_counter()
            st = SpeculativeStats()
            out = generate(model, ids, past_key_values=copy.deepcopy(base), draft_policy=policy, draft_options=dict(opts),
                           gamma=gamma, max_new_tokens=new_tokens, eos_token_id=None, stats=st)
            new = out[0, ids.shape[1] :].tolist()
            diff = [j for j, (a, b) in enumerate(zip(new, plain)) if a != b]
            if len(new) != len(plain) and not diff:
                diff = [min(len(new), len(plain))]
            first = diff[0] if diff else None
            name = f"{policy}({', '.join(f'{k}={v}' for k, v in opts.items())}) gamma={gamma}"
            results.append(GreedyCheck(prompt, kind, ids.shape[1], name, not diff, st.acceptance_rate, first,
                                       margins[first] if first is not None and first < len(margins) else None,
                                       time.perf_counter() - t))
        return results
    finally:
        if patched_here:
            kvkit.unpatch(model)


def format_result(r: GreedyCheck) -> str:
    line = (f"prompt {r.prompt} ({r.kind}, {r.prompt_tokens} tokens), {r.setting}: acceptance {r.acceptance:.2f}, "
            f"identical={r.identical} ({r.seconds:.1f}s)")
    if not r.identical:
        gap = "n/a" if r.margin is None else f"{r.margin:.4f}"
        line += f"; first difference at new token {r.first_mismatch}, plain top-1 minus top-2 logit there: {gap}"
    return line
