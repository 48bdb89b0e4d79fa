"""``kvkit calibrate shadowkv``: ShadowKV's SVD rank from the spectral energy of the model's pre-RoPE keys.

:func:`calibrate_shadowkv` returns ``(options, evidence)``: ``{"rank": r}``, the smallest rank (a multiple of
``multiple``) whose rebuilt keys stay within a relative error bound in every layer, and the error per rank it was
chosen from; written by :func:`kvkit.calibration.write_section` with the command that made them.
"""

from __future__ import annotations

import math
import time

import torch

from kvkit.calibrate.needles import essay_text
from kvkit.calibrate.parsers import shadowkv_command
from kvkit.calibrate.registry import calibrator


def _key_modules(model):
    """Per decoder layer (in order): the module whose output is the layer's pre-RoPE keys (``k_norm`` when the
    attention has one, else ``k_proj``)."""
    mods = []
    for _name, m in model.named_modules():
        if hasattr(m, "k_proj") and hasattr(m, "layer_idx"):
            mods.append((m.layer_idx, getattr(m, "k_norm", None) or m.k_proj))
    return [m for _, m in sorted(mods, key=lambda x: x[0])]


@torch.no_grad()
def pre_rope_keys(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The pre-RoPE keys of every layer for one sequence: ``[S, Hkv*D]`` fp32 per layer."""
    mods = _key_modules(model)
    if not mods:
        raise ValueError("shadowkv calibration: found no attention modules with k_proj and a layer_idx")
    got: list = [None] * len(mods)

    def hook(i):
        def f(_m, _inp, out):
            got[i] = out.detach().reshape(out.shape[0], out.shape[1], -1)[0].float()
        return f

    hs = [m.register_forward_hook(hook(i)) for i, m in enumerate(mods)]
    try:
        model(input_ids=input_ids.to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        for h in hs:
            h.remove()
    return got


def key_rank_errors(keys: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius error of the best rank-r approximation of ``keys [S, W]`` for r = 0..W:
    ``sqrt(sum_{i>r} s_i^2 / sum s_i^2)`` (what ShadowKV's truncated SVD loses)."""
    s2 = torch.linalg.svdvals(keys.double()) ** 2
    tail = torch.cat([s2.flip(0).cumsum(0).flip(0), s2.new_zeros(1)])  # tail[r] = sum_{i>=r} s_i^2
    err = (tail / s2.sum()).clamp(min=0).sqrt()
    W = keys.shape[1]
    if err.numel() < W + 1:  # S < W: rank >= S is exact
        err = torch.cat([err, err.new_zeros(W + 1 - err.numel())])
    return err.float()


def _mean_key_errors(model, tokenizer, length: int, samples: int, seed: int, log) -> torch.Tensor:
    """``[L, W+1]``: :func:`key_rank_errors` per layer, averaged over ``samples`` essay excerpts of ``length`` tokens."""
    text = essay_text()
    g = torch.Generator().manual_seed(seed)
    errs = None
    for i in range(samples):
        off = int(torch.randint(0, len(text) - 8 * length, (1,), generator=g))
        ids = tokenizer.encode(text[off: off + 6 * length], add_special_tokens=False)[:length]
        keys = pre_rope_keys(model, torch.tensor([ids]))
        e = torch.stack([key_rank_errors(k) for k in keys])  # [L, W+1]
        errs = e if errs is None else errs + e
        log(f"sample {i}: {len(ids)} tokens, {len(keys)} layers, key width {keys[0].shape[1]}")
    return errs / samples


def calibrate_shadowkv(model, tokenizer, length: int = 2048, samples: int = 3, max_error: float = 0.10,
                       multiple: int = 8, seed: int = 0, log=print) -> tuple[dict, dict]:
    """Smallest rank (a multiple of ``multiple``) whose rebuilt pre-RoPE keys have a relative error of at most
    ``max_error`` in every layer, averaged over ``samples`` essay excerpts of ``length`` tokens."""
    if not 0 < max_error < 1:
        raise ValueError(f"shadowkv calibration: max_error must be in (0, 1), got {max_error!r}")
    t0 = time.perf_counter()
    errs = _mean_key_errors(model, tokenizer, length, samples, seed, log)
    L, W = errs.shape[0], errs.shape[1] - 1
    worst = errs.max(dim=0).values  # [W+1]
    ok = [r for r in range(1, W + 1) if worst[r] <= max_error]
    rank = ok[0] if ok else W
    rank = min(W, multiple * math.ceil(rank / multiple))
    paper = max(1, round(160 / 1024 * W))
    grid = sorted({paper, rank, *range(multiple, W + 1, max(multiple, W // 12)), W})
    per_rank = {str(r): {"max_layer_error": round(float(worst[r]), 4), "mean_layer_error": round(float(errs[:, r].mean()), 4)}
                for r in grid}
    evidence = {
        "criterion": f"smallest rank (multiple of {multiple}) with relative key error <= {max_error} in every layer",
        "key_width": W, "layers": L, "samples": samples, "tokens_per_sample": length,
        "paper_rank": paper,
        "paper_rank_error_per_layer": [round(float(x), 3) for x in errs[:, paper]],
        "chosen_rank_error_per_layer": [round(float(x), 3) for x in errs[:, rank]],
        "key_error_per_rank": per_rank,
        "data": "essay excerpts from the last third of PaulGrahamEssays.json (not RULER's haystack start)",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return {"rank": rank}, evidence


# ---- the command ----------------------------------------------------------------------------------------------
@calibrator("shadowkv", command=shadowkv_command)
def run(model, tokenizer, args, out, log) -> tuple[dict, dict]:
    return calibrate_shadowkv(model, tokenizer, length=args.length, samples=args.samples, max_error=args.max_error,
                              seed=args.seed, log=log)
