"""Refine DuoAttention patterns where they are unsure: decide the heads near the sparsity cut on calibration needles.

Why: gate optimisation (:mod:`kvkit.calibrate.duo`) separates most KV heads clearly, but which few heads land just
above or below the sparsity cut depends on the run (its text, length, regulariser, seed), and single needles are
lost or kept by exactly those heads. Given several calibrated patterns of one model, the heads every pattern keeps
at the sparsity stay retrieval heads, the heads no pattern keeps stay streaming heads, and the ones in between (the
*swing* heads) are decided by measurement: how much each one changes the answers to needle questions.

Algorithm, at sparsity ``s`` over ``N`` KV heads (``k = N - round(s * N)`` retrieval heads):

1. ``fixed`` = heads in every source's top ``k``; ``swing`` = heads in some source's top ``k`` but not all
   (one source: the ``window`` heads on each side of its cut); ``m = k - |fixed|`` of the swing heads are picked.
2. Samples: ``samples`` calibration needles (:func:`kvkit.calibrate.needles.make_samples`: kvkit's vault needles,
   7-digit numbers and UUID-shaped codes, 1 or 3 needles, haystacks from the calibration text only) of ``length``
   tokens, question-agnostic (context prefilled once with exact attention and replayed into each candidate's cache,
   the question fed after it). Samples the full cache does not answer exactly (every answer token its top choice,
   teacher-forced) are dropped.
3. ``S(mask)`` = mean teacher-forced log-probability of the answer tokens under duo with retrieval heads ``mask``.
   Each swing head ``h`` scores ``gain(h) = [S(fixed + h) - S(fixed)] + [S(fixed + swing) - S(fixed + swing - h)]``:
   what it adds to the sure heads alone plus what the others lose without it.
4. The ``m`` swing heads with the highest gain (ties: the sources' mean rank) join ``fixed``.
5. Validation on ``samples`` fresh needles (seed + 1): the refined mask against each source's own mask, reported.

The written pattern's alpha are normalised ranks (like :mod:`kvkit.calibrate.duo_merge`): fixed heads on top in
their mean-rank order, then the swing heads by gain, then the rest, so it binarises to the refined mask at ``s`` and
orders heads sensibly at other sparsities. Cost: one exact prefill per sample plus ``2 * |swing| + 2`` replays and
answer decodes per sample (``len(swing) + 1`` candidate masks in each direction).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import kvkit
from kvkit.calibrate import needles
from kvkit.calibrate.duo_merge import merge_alphas, read_sources
from kvkit.policies.duo import binarize
from kvkit.policies.duo_patterns import save_pattern
from kvkit.workloads.prompts import encode
from kvkit.workloads.shared_prefill import record_prefill


def swing_split(alphas: list[torch.Tensor], sparsity: float, window: int = 4) -> tuple[torch.Tensor, list, int]:
    """``(fixed [L, H] bool, swing [(layer, head)], m)``: heads every source keeps at ``sparsity``, heads some but
    not all keep (one source: ``window`` heads each side of its cut, by gate) and how many swing heads to pick."""
    masks = [binarize(a, sparsity) for a in alphas]
    k = int(masks[0].sum())
    if len(alphas) == 1:
        a = alphas[0].reshape(-1)
        order = torch.sort(-a, stable=True).indices  # highest gate first (binarize breaks ties the same way)
        lo, hi = max(0, k - window), min(a.numel(), k + window)
        fixed = torch.zeros(a.numel(), dtype=torch.bool)
        fixed[order[:lo]] = True
        swing_flat = order[lo:hi].tolist()
        fixed = fixed.view_as(alphas[0])
    else:
        all_keep = torch.stack(masks).all(0)
        any_keep = torch.stack(masks).any(0)
        fixed = all_keep
        swing_flat = (any_keep & ~all_keep).reshape(-1).nonzero().flatten().tolist()
    H = alphas[0].shape[1]
    swing = [(i // H, i % H) for i in swing_flat]
    m = k - int(fixed.sum())
    if not 0 <= m <= len(swing):
        raise ValueError(f"duo-refine: {m} heads to pick from {len(swing)} swing heads; the sources disagree on "
                         "their number of retrieval heads (give patterns of one model)")
    return fixed, swing, m


def _with(mask: torch.Tensor, heads, value: bool) -> torch.Tensor:
    out = mask.clone()
    for li, h in heads:
        out[li, h] = value
    return out


def mask_options(mask: torch.Tensor) -> dict:
    """duo options whose retrieval heads are exactly ``mask`` (gates 1 / 0 and the matching sparsity)."""
    return {"pattern": mask.to(torch.float64).tolist(), "sparsity": 1.0 - float(mask.to(torch.float64).mean())}


def score_masks(model, tokenizer, samples, masks: dict, log=print, duo_options: dict | None = None) -> dict:
    """``{label: [(logprob, exact), ...]}`` per sample full answers exactly, for duo with each ``masks[label]``
    (context replayed, question after it); full's own scores under ``"full"``."""
    out = {"full": [], **{lab: [] for lab in masks}}
    try:
        for i, s in enumerate(samples):
            t0 = time.perf_counter()
            kvkit.patch(model, "full")
            rec = record_prefill(model, encode(tokenizer, s.prompt[: s.context_end]).to(model.device))
            lp, ok = needles.answer_score(model, tokenizer, s, rec)
            if not ok:
                log(f"{s.id}: full does not answer it exactly (mean log-prob {lp:.3f}); dropped")
                continue
            out["full"].append((lp, ok))
            for lab, mask in masks.items():
                kvkit.patch(model, "duo", **mask_options(mask), **(duo_options or {}))
                out[lab].append(needles.answer_score(model, tokenizer, s, rec))
            del rec
            log(f"{s.id} ({i + 1}/{len(samples)}, {s.needles} needle(s)): {time.perf_counter() - t0:.0f} s")
    finally:
        kvkit.unpatch(model)
    return out


def _mean(rows) -> float:
    return sum(lp for lp, _ in rows) / len(rows) if rows else float("nan")


def refine(model, tokenizer, alphas: list[torch.Tensor], sparsity: float, *, window: int = 4, length: int = 2048,
           samples: int = 16, seed: int = 0, log=print, duo_options: dict | None = None) -> tuple[torch.Tensor, dict]:
    """Refined alpha (normalised ranks) and the evidence (swing heads, gains, validation); see the module docstring."""
    if not 0.0 < sparsity < 1.0:
        raise ValueError(f"duo-refine: sparsity must be a fraction strictly between 0 and 1, got {sparsity!r}")
    t0 = time.perf_counter()
    fixed, swing, m = swing_split(alphas, sparsity, window)
    ranks = merge_alphas(alphas) if len(alphas) > 1 else alphas[0].to(torch.float64)
    log(f"duo-refine: {int(fixed.sum())} heads fixed, {m} to pick from {len(swing)} swing heads {swing}")
    every = _with(fixed, swing, True)
    masks = {"fixed": fixed, "all": every}
    for li, h in swing:
        masks[f"+{li}.{h}"] = _with(fixed, [(li, h)], True)
        masks[f"-{li}.{h}"] = _with(every, [(li, h)], False)
    data = needles.make_samples(tokenizer, samples, length, seed=seed)
    res = score_masks(model, tokenizer, data, masks, log, duo_options)
    if not res["full"]:
        raise ValueError("duo-refine: the full cache answered none of the calibration needles exactly; use a longer "
                         "--samples or another --length")
    S = {lab: _mean(rows) for lab, rows in res.items()}
    gain = {(li, h): (S[f"+{li}.{h}"] - S["fixed"]) + (S["all"] - S[f"-{li}.{h}"]) for li, h in swing}
    by_gain = sorted(swing, key=lambda x: (-gain[x], -float(ranks[x])))
    chosen = by_gain[:m]
    refined = _with(fixed, chosen, True)
    # ranks: fixed heads (their own order), then the swing heads by gain, then the rest (their own order)
    L, H = fixed.shape
    rest = [(li, h) for li in range(L) for h in range(H) if not fixed[li, h] and (li, h) not in gain]
    top = sorted([(li, h) for li in range(L) for h in range(H) if fixed[li, h]], key=lambda x: -float(ranks[x]))
    order = top + by_gain + sorted(rest, key=lambda x: -float(ranks[x]))
    alpha = torch.empty(L, H, dtype=torch.float64)
    n = L * H
    for pos, (li, h) in enumerate(order):
        alpha[li, h] = (n - 1 - pos) / (n - 1)
    if not torch.equal(binarize(alpha, sparsity), refined):  # ranks are distinct, so this cannot happen
        raise RuntimeError("duo-refine: the written ranks do not binarise to the refined heads")
    # validation on fresh calibration needles: the refined heads against each source's own
    check = {"refined": refined, **{f"source{i + 1}": binarize(a, sparsity) for i, a in enumerate(alphas)}}
    val = score_masks(model, tokenizer, needles.make_samples(tokenizer, samples, length, seed=seed + 1), check, log,
                      duo_options)
    evidence = {
        "sparsity": sparsity, "length": length, "samples": samples, "seed": seed,
        "data": needles.describe_data() + " (seed " + str(seed) + "; validation seed " + str(seed + 1) + ")",
        "fixed": int(fixed.sum()), "picked": m,
        "swing": [{"layer": li, "kv_head": h, "gain": round(gain[(li, h)], 4), "chosen": (li, h) in chosen}
                  for li, h in by_gain],
        "scored_samples": len(res["full"]),
        "mean_logprob": {lab: round(v, 4) for lab, v in S.items()},
        "validation": {lab: {"mean_logprob": round(_mean(rows), 4), "exact": sum(ok for _, ok in rows),
                             "of": len(rows)} for lab, rows in val.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return alpha, evidence


def refine_files(model, tokenizer, paths: list, out, sparsity: float, command: str | None = None, **kwargs) -> Path:
    """Refine the pattern files ``paths`` (one model) and write the result to ``out`` with its evidence."""
    paths, files, meta = read_sources(paths, "refine")
    alpha, evidence = refine(model, tokenizer, [torch.tensor(f.alpha, dtype=torch.float64) for f in files],
                             sparsity, **kwargs)
    calibration = {
        "method": "kvkit.calibrate.duo_refine: swing heads near the sparsity cut decided on calibration needles; "
                  "the values are ranks in [0, 1], not gates",
        "sources": [{"path": str(p), "sha256": f.sha256} for p, f in zip(paths, files)],
        "evidence": evidence,
    }
    if command:
        calibration["command"] = command
    return save_pattern(out, alpha, meta, calibration)
