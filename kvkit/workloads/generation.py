"""A greedy generation of one prompt under a policy's cache (the model side of an eval sample or a calibration's
needle; the prompt itself: :mod:`kvkit.workloads.prompts`).

Generation (:func:`generate`): greedy ``model.generate`` with an explicit cache: ``kvkit.KVCache`` when the model is
patched, a peer's cache (:mod:`kvkit.workloads.peers`) on the unpatched model, transformers' own otherwise. With a
context/question split the context is prefilled (and compressed) first and the question fed on top of what the policy
kept (question-agnostic compression, as kvpress evaluates), or rebuilt from a recorded prefill (policy sweeps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import kvkit
from kvkit.compat import cache_kw
from kvkit.workloads import peers
from kvkit.workloads.prompts import encode
from kvkit.workloads.shared_prefill import replay_prefill


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    kv_bytes: int
    kv_offloaded: int
    #: bytes one decode step read at the end (``KVCache.read_nbytes``; a peer's: its bytes held); None: not known.
    #: A policy that held and read all of full's bytes did not compress (e.g. a prompt below its ``min_prompt``)
    kv_read: int | None = None


def generate(model, tokenizer, prompt: str, max_new_tokens: int, context_end: int | None = None,
             replay=None, peer: tuple[str, dict] | None = None) -> Generation:
    """Greedy ``model.generate`` on one prompt with an explicit ``kvkit.KVCache`` (when patched).

    With ``context_end`` (a character offset), the context ``prompt[:context_end]`` is prefilled first
    and compressed by the policy; the rest (question, answer prefix) is then fed on top of what the
    policy kept, as kvpress evaluates (question-agnostic compression). Without the split, the
    question would be read with full attention during prefill and eviction would cost nothing.

    ``replay``: a :class:`kvkit.workloads.shared_prefill.PrefillRecording` of the context (``prompt[:context_end]``):
    the policy's cache is rebuilt from it instead of running the context through the model again
    (policy sweeps; identical result, see ``shared_prefill``). ``seconds`` then excludes the shared prefill.

    ``peer``: ``(name, options)`` of a :mod:`kvkit.workloads.peers` cache (transformers' ``QuantizedCache``) used on the
    unpatched model instead, with the same split; its ``kv_bytes`` are :func:`kvkit.workloads.peers.cache_nbytes`.
    """
    patched = kvkit.patched_policy(model) is not None
    if context_end is not None and 0 < context_end < len(prompt):
        ctx = encode(tokenizer, prompt[:context_end])
        ids = torch.cat([ctx, encode(tokenizer, prompt[context_end:])], dim=1).to(model.device)
    else:
        ctx = None
        ids = encode(tokenizer, prompt).to(model.device)
    kwargs = {}
    cache = None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0 = time.perf_counter()
    with torch.no_grad():
        if peer is not None:
            if patched:
                raise ValueError(f"the peer row {peer[0]!r} runs on the unpatched model; kvkit.unpatch(model) first")
            cache = peers.make_cache(model, *peer)
            if ctx is not None:
                model(input_ids=ids[:, : ctx.shape[1]], **cache_kw(cache), use_cache=True)
            kwargs.update(cache_kw(cache))
        elif patched:  # its first forward: the context (prefilled here), else the whole prompt (generate's)
            cache = kvkit.KVCache(model, prompt_length=(ctx if ctx is not None else ids).shape[1])
            if ctx is not None and replay is not None:
                if replay.tokens != ctx.shape[1]:
                    raise ValueError(f"replay: the recording holds {replay.tokens} context tokens, this prompt's "
                                     f"context has {ctx.shape[1]}")
                # the context's own attention output is not needed (its last logits come from the recording)
                cache = replay_prefill(model, replay, cache=cache, skip_prompt_attention=True)
            elif ctx is not None:
                n = ctx.shape[1]
                cache, _ = kvkit.prefill(model, ids[:, :n], chunk_size=n, cache=cache)
            kwargs.update(cache_kw(cache))
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
            **kwargs,
        )
    dt = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=int(ids.shape[1]),
        new_tokens=int(new.shape[0]),
        seconds=dt,
        kv_bytes=(peers.cache_nbytes(cache) if peer is not None else int(cache.nbytes())) if cache is not None else 0,
        kv_offloaded=int(cache.offloaded_nbytes()) if cache is not None and peer is None else 0,
        kv_read=(None if cache is None else peers.cache_nbytes(cache) if peer is not None else int(cache.read_nbytes())),
    )
