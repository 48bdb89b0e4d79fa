"""``kvkit calibrate cake``: CAKE's layer-preference temperatures from a needle sweep, then its pooling kernel.

:func:`calibrate_cake` returns ``(options, evidence)``: ``tau1`` / ``tau2`` (the pair answering the most calibration
needles, the context compressed before the question) and, unless the second stage is skipped, the indicator's
``pool_kernel`` (and ``pool_window`` when not centered) from a question-aware :func:`~kvkit.calibrate.search.pooling_sweep`
at those taus; written by :func:`kvkit.calibration.write_section`.
"""

from __future__ import annotations

import time

from kvkit.calibrate import needles
from kvkit.calibrate.parsers import cake_command
from kvkit.calibrate.registry import calibrator, sweep_args
from kvkit.calibrate.search import picked, pooling_sweep, window_option
from kvkit.policies.cake import model_taus

CAKE_TAUS = [(1.0, 1.0), (0.5, 0.5), (2.0, 2.0), (1.0, 2.0), (2.0, 1.0), (1.6, 0.4), (0.5, 2.0), (2.0, 0.5), (4.0, 4.0)]


#: the indicator's pooling candidates: kernels with the paper's centered window, then (kernel, "trailing") (kvkit)
CAKE_KERNELS = (5, 15, 21, 31, 41, 61, (15, "trailing"), (31, "trailing"), (61, "trailing"))


def calibrate_cake(model, tokenizer, length: int = 2048, samples: int = 8, budget_fraction: float = 0.5,
                   seed: int = 0, kernels=CAKE_KERNELS, values: str = "mixed", log=print) -> tuple[dict, dict]:
    """The (tau1, tau2) of CAKE's layer preference ``H^(1/tau1) V^(1/tau2)`` that answers the most calibration
    needles at ``budget = budget_fraction * length``, the context compressed before the question (ties: the
    paper's value for the model first, then the order of ``CAKE_TAUS``); then, at those taus, the indicator's
    pooling kernel by :func:`pooling_sweep` (question in the prefill; the paper's 5 first). ``kernels=()`` skips
    the second stage. ``values``: the needles' values (:data:`kvkit.calibrate.needles.VALUE_KINDS`)."""
    t0 = time.perf_counter()
    budget = max(2, int(budget_fraction * length))
    paper, source = model_taus(model.config)
    cands = [tuple(paper)] + [t for t in CAKE_TAUS if tuple(t) != tuple(paper)]
    data = needles.make_samples(tokenizer, samples, length, seed=seed, values=values)
    specs = [(f"{t1},{t2}", "cake", dict(budget=budget, tau1=t1, tau2=t2)) for t1, t2 in cands]
    res = needles.score_policies(model, tokenizer, data, specs, log=log)
    table = needles.summarize(res, [s[0] for s in specs])
    best = max(range(len(cands)), key=lambda i: (table[specs[i][0]]["answered"], -i))
    t1, t2 = cands[best]
    pool = None
    if kernels:  # stage 2: the pooling kernel, question-aware, at the chosen taus
        pool, chosen = _pooling_stage(model, tokenizer, kernels, budget, t1, t2, length, samples, seed, values, log)
    evidence = {
        "criterion": f"most needles answered at budget {budget} of ~{length} tokens, context compressed before the "
                     "question; ties: the paper's taus, then the candidate order",
        "needles_answered_by_full": f"{sum(res['full'])}/{len(data)}",
        "per_taus": table,
        "paper_taus": list(paper),
        "paper_taus_from": source,
        "predictions": res["predictions"],
        "data": needles.describe_data(values),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if pool is not None:
        evidence["pooling"] = pool
        return {"tau1": t1, "tau2": t2, **picked(chosen, ("pool_kernel", "pool_window"))}, evidence
    return {"tau1": t1, "tau2": t2}, evidence


def _pooling_stage(model, tokenizer, kernels, budget: int, t1, t2, length: int, samples: int, seed: int,
                   values: str, log) -> tuple[dict, dict]:
    """The second stage at taus ``(t1, t2)``: ``(its evidence, the chosen candidate's options)``."""
    pspecs = []
    for cand in kernels:  # a kernel (centered) or (kernel, pool_window)
        k, win = (cand, "centered") if isinstance(cand, int) else cand
        pspecs.append((f"kernel {k}" + ("" if win == "centered" else f" {win}"), "cake",
                       dict(budget=budget, tau1=t1, tau2=t2, pool_kernel=k, **window_option(win))))
    pbest, ptable, pev = pooling_sweep(model, tokenizer, pspecs, length, samples, seed=seed, values=values, log=log)
    pool = {
        "criterion": f"most needles answered at budget {budget} of ~{length} tokens with taus ({t1}, {t2}), "
                     "question in the prefill (CAKE's protocol); ties: the higher mean teacher-forced "
                     "log-probability of the answers, then the candidate order (centered kernels, smallest first, then trailing)",
        "per_kernel": ptable,
        "paper_kernel": 5,
        **pev,
    }
    return pool, pspecs[pbest][2]


# ---- the command ----------------------------------------------------------------------------------------------
@calibrator("cake", command=cake_command)
def run(model, tokenizer, args, out, log) -> tuple[dict, dict]:
    kernels = CAKE_KERNELS if args.kernels is None else args.kernels
    return calibrate_cake(model, tokenizer, **sweep_args(args), kernels=kernels, log=log)
