"""Helpers for tests and examples: tiny random models, left-padded batches, greedy reference decoding, calibration files
written as given."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvkit import calibration
from kvkit.compat import cache_kw, output_cache
from kvkit.hostsync import HostSyncCounter

TINY_ARCHS = ("llama", "qwen2", "mistral")
#: every architecture of the support matrix (``kvkit doctor --matrix``)
MATRIX_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


def tiny_config(arch: str = "llama", **overrides):
    """A tiny random config of a supported architecture (GQA 4 query / 2 KV heads, head_dim 16)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        common["sliding_window"] = 24
    if arch in ("qwen2", "qwen3"):
        common["use_sliding_window"] = False
    if arch == "phi3":
        common["pad_token_id"] = 0
    if arch in ("gemma2", "gemma3_text"):
        # hybrid: local sliding-window layers around a global layer
        common.update(head_dim=16, sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        common["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    common.update(overrides)
    return AutoConfig.for_model(arch, **common)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random causal LM in fp32 with sdpa attention, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    attn = "eager" if arch == "gemma2" else "sdpa"  # transformers has no sdpa path for Gemma 2's soft-capping
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def left_padded_batch(lengths, vocab: int = 128, pad_id: int = 0, seed: int = 0):
    """Random prompts of the given lengths, left padded: returns (input_ids, attention_mask, prompts)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = p
        mask[i, T - len(p) :] = 1
    return ids, mask, prompts


@torch.no_grad()
def greedy(model, ids, steps: int, attention_mask=None, cache=None):
    """Plain greedy decoding with an explicit loop: returns (tokens [B, steps], logits list, cache)."""
    mask = attention_mask
    # as generate() does: with a padding mask, RoPE positions count real tokens only (a left-padded row
    # sees the same positions as its prompt alone; policies that quantise post-RoPE keys depend on it)
    posf = (lambda m: (m.long().cumsum(-1) - 1).clamp(min=0)) if mask is not None else None
    out = model(input_ids=ids, attention_mask=mask, **cache_kw(cache), use_cache=True,
                position_ids=None if mask is None else posf(mask))
    cache = output_cache(out)
    logits = [out.logits[:, -1]]
    toks = []
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        toks.append(nxt)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        out = model(input_ids=nxt, attention_mask=mask, **cache_kw(cache), use_cache=True,
                    position_ids=None if mask is None else posf(mask)[:, -1:])
        logits.append(out.logits[:, -1])
    return torch.cat(toks, dim=1), logits, cache


def random_ids(n: int, seed: int = 1, vocab: int = 128) -> torch.Tensor:
    """One random prompt ``[1, n]`` of token ids in ``[1, vocab)`` (0 is left for padding)."""
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_stacked(model, ids, steps: int = 10, mask=None):
    """``greedy`` with the per-step logits stacked: returns (tokens [B, steps], logits [B, steps+1, V], cache)."""
    toks, logits, cache = greedy(model, ids, steps, attention_mask=mask)
    return toks, torch.stack(logits, 1), cache


def reconstruction_scores_reference(model, ids, chunk: int, overlap: int, normalize: str = "held",
                                    sink: int = 0) -> torch.Tensor:
    """KVzip's scores written out with transformers' eager attention on the unpatched model: for each chunk of
    the context (cut from the end), the context followed by the chunk's repeat (``overlap`` tokens of the previous
    chunk first) runs as one sequence; a context token of the chunk scores the largest attention probability any
    repeat query of its KV head's group pays it. Returns ``[layers, H, S]``. The reference of
    :mod:`kvkit.stores.reconstruct` (tests of ``kvzip`` and of ``chelsea``'s reconstruction-scored protection); the
    model is left in eager attention. ``normalize="chunk"``: each probability renormalised over the reference's
    set (the first ``sink`` tokens before the chunk, the chunk's own tokens and the repeat), the ratio of two
    probabilities of one softmax being the ratio of their exponentials."""
    S = ids.shape[1]
    cfg = model.config
    H, g = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    out = torch.full((cfg.num_hidden_layers, H, S), -1.0)
    model.set_attn_implementation("eager")
    for e in range(S, 0, -chunk):
        lo, s = max(e - chunk, 0), max(e - chunk - overlap, 0)
        seq = torch.cat([ids, ids[:, s:e]], dim=1)
        att = model(seq, output_attentions=True, use_cache=False).attentions  # per layer [1, Hq, L, L]
        for li, a in enumerate(att):
            rows = a[0, :, S:, lo:e]  # repeat queries -> the chunk's own context tokens
            if normalize == "chunk":
                local = rows.sum(-1) + a[0, :, S:, S:].sum(-1) + a[0, :, S:, : min(sink, lo)].sum(-1)
                rows = rows / local.unsqueeze(-1)
            out[li, :, lo:e] = rows.amax(dim=1).view(H, g, e - lo).amax(dim=1)
    return out


#: each policy's options for the tiny random models (budgets of a few tokens, so a 30-60-token prompt compresses;
#: ``kvkit doctor``'s support matrix, tests/policies/test_policy_contract.py); duo's pattern rows repeat per layer
#: (:func:`policy_test_options`)
TEST_OPTIONS: dict[str, dict] = {
    "full": {},
    "streaming": dict(budget=16, sink=2, tail=4),
    "duo": dict(pattern=[[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]], sparsity=0.5, sink=2, recent=8, tail=4),
    "cake": dict(budget=16, window=4),
    "chelsea": dict(ratio=0.5, chunk_size=8, window=4, sink=2, merge_interval=8),
    "kvzip": dict(budget=16, window=4, sink=2, chunk=8, overlap=2, tail=4),
    "shadowkv": dict(budget=16, min_prompt=16),
    "snapkv": dict(budget=16, window=4, kernel=3, tail=4),
    "tidal": dict(budget=8),
    "zipcache": dict(requant_interval=4),
}


def tiny_options(policy: str) -> dict:
    """A copy of ``policy``'s :data:`TEST_OPTIONS`; ValueError naming the table for a policy it lacks."""
    if policy not in TEST_OPTIONS:
        raise ValueError(f"no tiny-model options for policy {policy!r}: add its entry to kvkit.testing.TEST_OPTIONS "
                         f"(known: {', '.join(TEST_OPTIONS)})")
    return dict(TEST_OPTIONS[policy])


def policy_test_options(policy: str, layers: int = 3) -> dict:
    """A policy's :data:`TEST_OPTIONS` for a tiny model of ``layers`` layers: a per-layer head pattern (duo) gets one
    row per layer, repeating the declared rows."""
    opts = tiny_options(policy)
    if "pattern" in opts:
        opts["pattern"] = [opts["pattern"][i % len(opts["pattern"])] for i in range(layers)]
    return opts


def compression_marks(cache) -> list:
    """Every store's last compression point (``committed``), nested stores (duo's two halves) included: a step that
    changes them ran a compression event."""
    return [obj.committed for layer in cache.layers for obj in (layer, *vars(layer).values())
            if hasattr(obj, "committed") and hasattr(obj, "seen")]


@torch.no_grad()
def decode_step_syncs(model, lengths, steps: int = 12, seed: int = 4) -> list:
    """Host synchronisations of ``steps`` greedy single-token steps after the prefill of a left-padded batch of
    prompts of ``lengths``: one ``(HostSyncCounter, compressed)`` per step (``compressed``: a compression event ran
    in it, see :func:`compression_marks`)."""
    ids, mask, _ = left_padded_batch(lengths, seed=seed)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
    cache = output_cache(out)
    rows = []
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        before = compression_marks(cache)
        with HostSyncCounter() as syncs:
            out = model(input_ids=nxt, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1)[:, -1:],
                        **cache_kw(cache), use_cache=True)
        rows.append((syncs, compression_marks(cache) != before))
    return rows


def calibration_file(path, config, policies: dict, name: str = "tiny", raw: str | None = None):
    """Write a calibration file for the model of ``config`` at ``path`` exactly as given, unchecked (tests write
    hostile ones): kvkit's format and version, the model's identity under ``name``, ``policies`` as
    ``{policy: {"options": {...}, ...}}``. ``raw``, when given, replaces the JSON string ``"@RAW@"`` in the text
    (values JSON cannot carry, such as ``NaN`` or a huge exponent). The calibration store's cache is cleared, so the
    next patch reads it. Returns ``path``."""
    data = {"format": calibration.FORMAT, "version": calibration.VERSION,
            "model": calibration.identity(config, name), "policies": policies}
    text = json.dumps(data)
    Path(path).write_text(text if raw is None else text.replace('"@RAW@"', raw))
    calibration._CACHE.clear()
    return path


class ModelLoaded(Exception):
    """Raised instead of loading a model (the ``no_model_load`` test fixture): an input check must come first."""
