"""``kvkit calibrate chelsea``: Chelsea's chunk size and protection score from a question-aware needle sweep.

:func:`calibrate_chelsea` returns ``(options, evidence)``: the ``chunk_size`` / ``protect_kernel`` /
``protect_pooling`` / ``protect_window`` with which Chelsea at a ratio and ``protect = 0.8 x ratio`` answers the most
calibration needles, the question in the prefill, by :func:`~kvkit.calibrate.search.pooling_sweep`; written by
:func:`kvkit.calibration.write_section`.
"""

from __future__ import annotations

import time

from kvkit.calibrate.parsers import chelsea_command
from kvkit.calibrate.registry import calibrator, sweep_args
from kvkit.calibrate.search import picked, pool_label, pooling_sweep

#: (chunk_size, protect_kernel, protect_pooling, protect_window) candidates: kvkit's fallback first (64-token chunks,
#: SnapKV's max-pooled kernel 7, centered), then wider / trailing protection scores, then larger chunks (a chunk keeps
#: a share of its tokens exact: a needle sentence with a UUID may not fit the share of a 64-token chunk)
CHELSEA_PROTECTION = ((64, 7, "max", "centered"), (64, 31, "max", "trailing"), (64, 61, "avg", "trailing"),
                      (128, 7, "max", "centered"), (128, 31, "max", "trailing"), (128, 61, "avg", "trailing"),
                      (256, 31, "max", "trailing"))
#: the share of a chunk's kept slots the calibration protects (protect = CHELSEA_PROTECT_SHARE * ratio)
CHELSEA_PROTECT_SHARE = 0.8


def calibrate_chelsea(model, tokenizer, length: int = 2048, samples: int = 8, budget_fraction: float = 0.5,
                      seed: int = 0, candidates=CHELSEA_PROTECTION, values: str = "mixed",
                      log=print) -> tuple[dict, dict]:
    """Chelsea's ``chunk_size`` and protection score (``protect_kernel`` / ``protect_pooling`` / ``protect_window``)
    with which Chelsea at ``ratio = budget_fraction`` and ``protect = 0.8 * ratio`` (kvkit's protection of the
    highest-attention tokens) answers the most calibration needles, the question in the prefill (the protection's
    observation window is then the question), by :func:`pooling_sweep` (ties: log-probability, then the order of
    ``candidates``: kvkit's fallback first)."""
    t0 = time.perf_counter()
    if not 0 < budget_fraction < 1:
        raise ValueError(f"chelsea calibration: budget_fraction must be in (0, 1); got {budget_fraction}")
    protect = round(CHELSEA_PROTECT_SHARE * budget_fraction, 4)
    names = ("chunk_size", "protect_kernel", "protect_pooling", "protect_window")
    specs = []
    for cand in candidates:
        o = dict(zip(names, cand))
        specs.append((f"chunk {o['chunk_size']}, " + pool_label(*cand[1:]), "chelsea",
                      dict(ratio=budget_fraction, protect=protect, **o)))
    best, table, pev = pooling_sweep(model, tokenizer, specs, length, samples, seed=seed, values=values, log=log)
    chosen = specs[best][2]
    evidence = {
        "criterion": f"most needles answered at ratio {budget_fraction}, protect {protect}, ~{length} tokens, question "
                     "in the prefill; ties: the higher mean teacher-forced log-probability of the answers, then the "
                     "candidate order (kvkit's fallback first)",
        "per_setting": table,
        "fallback": list(candidates[0]),
        **pev,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return picked(chosen, names), evidence


@calibrator("chelsea", command=chelsea_command)
def run(model, tokenizer, args, out, log) -> tuple[dict, dict]:
    return calibrate_chelsea(model, tokenizer, **sweep_args(args), log=log)
