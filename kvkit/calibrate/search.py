"""What the needle-sweep calibrators share: the mean answer log-probability of a candidate, the pooling candidates'
labels and options, and :func:`pooling_sweep` (question-aware scoring of pooling candidates, the stage CAKE's,
SnapKV's and Chelsea's calibrations have in common).

A sweep scores ``(label, policy, options)`` specs on :mod:`kvkit.calibrate.needles` samples; the needle functions are
looked up on that module when a sweep runs (tests replace them there).
"""

from __future__ import annotations

from kvkit.calibrate import needles


def mean_logprob(res: dict, label: str) -> float | None:
    """The mean teacher-forced log-probability of ``label``'s answers in a :func:`~kvkit.calibrate.needles.score_policies`
    result scored with ``margin=True`` (rounded to 4 places); None when it has none."""
    lp = res.get("logprob", {})
    return round(sum(lp[label]) / len(lp[label]), 4) if lp.get(label) else None


def window_option(window: str) -> dict:
    """A pooling candidate's ``pool_window`` option: none for the papers' centered window (a centered
    candidate's calibration section names no ``pool_window``)."""
    return {} if window == "centered" else {"pool_window": window}


def picked(options: dict, names) -> dict:
    """The calibrated options of the chosen candidate (``names`` it sets, in order)."""
    return {k: options[k] for k in names if k in options}


def pool_label(kernel: int, pooling: str, window: str = "centered") -> str:
    return f"{kernel},{pooling}" + ("" if window == "centered" else f",{window}")


def pooling_sweep(model, tokenizer, specs, length: int, samples: int, seed: int = 0, values: str = "mixed",
                  log=print):
    """Score ``(label, policy, options)`` specs on calibration needles with the question in the prefill, half of
    them in the far form (:data:`~kvkit.calibrate.needles.NEEDLE_FAR`: the window's queries find the key, pooling
    must reach from there to the value's last token). Returns ``(best index, table, evidence)``: the most needles
    answered, ties by the higher mean teacher-forced log-probability of the answers, then the order of ``specs``;
    ``evidence`` holds the fields every pooling calibration records (full's needles and log-probability, the
    candidates' predictions, the data)."""
    data = needles.make_samples(tokenizer, samples, length, seed=seed, far=True, values=values)
    res = needles.score_policies(model, tokenizer, data, specs, log=log, margin=True, question_aware=True)
    table = needles.summarize(res, [s[0] for s in specs])
    for lab, _, _ in specs:
        lp = mean_logprob(res, lab)
        if lp is not None:
            table[lab]["answer_logprob"] = lp
    best = max(range(len(specs)), key=lambda i: (table[specs[i][0]]["answered"],
                                                 table[specs[i][0]].get("answer_logprob", float("-inf")), -i))
    evidence = {
        "needles_answered_by_full": f"{sum(res['full'])}/{len(data)}",
        "full_answer_logprob": mean_logprob(res, "full"),
        "predictions": res["predictions"],
        "data": needles.describe_data(values, far=True, question_aware=True),
    }
    return best, table, evidence
