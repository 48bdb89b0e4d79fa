"""``kvkit calibrate snapkv``: SnapKV's pooling (kernel, avg|max, centered|trailing window) from a question-aware
needle sweep.

:func:`calibrate_snapkv` returns ``(options, evidence)``: the ``kernel`` / ``pooling`` (and ``pool_window`` when not
centered) with which SnapKV at a budget fraction of the context answers the most calibration needles, the question
in the prefill, by :func:`~kvkit.calibrate.search.pooling_sweep`; written by
:func:`kvkit.calibration.write_section`.
"""

from __future__ import annotations

import time

from kvkit.calibrate.parsers import snapkv_command
from kvkit.calibrate.registry import calibrator, sweep_args
from kvkit.calibrate.search import picked, pool_label, pooling_sweep, window_option

#: (kernel, pooling[, pool_window]) candidates: the paper's first, then wider average pooling, then max
#: pooling (the sweep on the default model: results/calibration/README.md).
SNAPKV_POOLING = ((5, "avg"), (15, "avg"), (21, "avg"), (31, "avg"), (41, "avg"), (61, "avg"),
                  (15, "max"), (21, "max"), (31, "max"),
                  # kvkit: the trailing window (a token pooled with the kernel - 1 before it; see POOL_WINDOWS)
                  (15, "avg", "trailing"), (31, "avg", "trailing"), (61, "avg", "trailing"))


def calibrate_snapkv(model, tokenizer, length: int = 2048, samples: int = 8, budget_fraction: float = 0.5,
                     seed: int = 0, candidates=SNAPKV_POOLING, values: str = "mixed",
                     log=print) -> tuple[dict, dict]:
    """The pooling (kernel, avg|max, centered|trailing window) with which SnapKV at ``budget = budget_fraction * length`` answers the most
    calibration needles, the question in the prefill (SnapKV's setting: the observation window is the question),
    by :func:`pooling_sweep` (ties: log-probability, then the paper's (5, avg) first, narrower kernels first)."""
    t0 = time.perf_counter()
    if not 0 < budget_fraction < 1:
        raise ValueError(f"snapkv calibration: budget_fraction must be in (0, 1); got {budget_fraction}")
    budget = max(2, int(budget_fraction * length))
    specs = []
    for cand in candidates:  # (kernel, pooling) or (kernel, pooling, pool_window)
        k, pool, win = (*cand, "centered")[:3]
        specs.append((pool_label(k, pool, win), "snapkv", dict(budget=budget, kernel=k, pooling=pool,
                                                               **window_option(win))))
    best, table, pev = pooling_sweep(model, tokenizer, specs, length, samples, seed=seed, values=values, log=log)
    chosen = specs[best][2]
    evidence = {
        "criterion": f"most needles answered at budget {budget} of ~{length} tokens, question in the prefill; ties: "
                     "the higher mean teacher-forced log-probability of the answers, then the candidate order",
        "per_pooling": table,
        "paper_pooling": [5, "avg"],
        **pev,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return picked(chosen, ("kernel", "pooling", "pool_window")), evidence


@calibrator("snapkv", command=snapkv_command)
def run(model, tokenizer, args, out, log) -> tuple[dict, dict]:
    return calibrate_snapkv(model, tokenizer, **sweep_args(args), log=log)
