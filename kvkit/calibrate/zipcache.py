"""``kvkit calibrate zipcache``: ZipCache's bit widths, the cheapest candidate that keeps the calibration needles.

:func:`calibrate_zipcache` returns ``(options, evidence)``: the high_ratio / high_bits / low_bits / key_bits of the
candidate with the fewest code bits (:func:`zipcache_bits`) that answers every needle the full cache answers, and
what each candidate tried answered; written by :func:`kvkit.calibration.write_section`.
"""

from __future__ import annotations

import time

import kvkit
from kvkit.calibrate import needles
from kvkit.calibrate.parsers import zipcache_command
from kvkit.calibrate.registry import calibrator
from kvkit.workloads.generation import generate
from kvkit.workloads.prompts import encode
from kvkit.workloads.shared_prefill import record_prefill


def zipcache_bits(o: dict) -> float:
    """Mean code bits per token and KV head element, keys + values (statistics not counted)."""
    hr, hb, lb = o.get("high_ratio", 0.6), o.get("high_bits", 4), o.get("low_bits", 2)
    v = hr * hb + (1 - hr) * lb
    k = o["key_bits"] if o.get("key_bits") else v
    return k + v


ZIPCACHE_CANDIDATES = [
    dict(high_ratio=0.6, high_bits=4, low_bits=2),  # the paper
    dict(high_ratio=0.6, high_bits=4, low_bits=2, key_bits=4),
    dict(high_ratio=0.8, high_bits=4, low_bits=2, key_bits=4),
    dict(high_ratio=1.0, high_bits=4, low_bits=4, key_bits=4),
    dict(high_ratio=0.6, high_bits=4, low_bits=2, key_bits=8),
    dict(high_ratio=0.4, high_bits=8, low_bits=4),
    dict(high_ratio=0.6, high_bits=8, low_bits=4),
    dict(high_ratio=0.6, high_bits=8, low_bits=4, key_bits=8),
]


def _label(o: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in o.items())


def calibrate_zipcache(model, tokenizer, length: int = 2048, samples: int = 8, seed: int = 0,
                       values: str = "mixed", log=print) -> tuple[dict, dict]:
    """The candidate with the fewest code bits that answers every needle the full cache answers (the most
    expensive candidate if none does). Each sample's context is prefilled once (recorded, kept in memory) and
    answered with the full cache; then the candidates run in order of bytes, each stopping at its first miss,
    and the first that answers every needle ends the sweep (the more expensive ones are not run)."""
    t0 = time.perf_counter()
    data = needles.make_samples(tokenizer, samples, length, seed=seed, values=values)
    cands = sorted(ZIPCACHE_CANDIDATES, key=zipcache_bits)
    recs, per, preds, chosen = [], {}, {}, None
    try:
        recs = _answered_by_full(model, tokenizer, data, log)
        chosen = _first_keeping_all(model, tokenizer, cands, recs, per, preds, log)
    finally:
        kvkit.unpatch(model)
    if chosen is None:
        chosen = cands[-1]
    evidence = {
        "criterion": "fewest code bits (keys + values) that answer every needle the full cache answers; "
                     "candidates in order of bits, each stops at its first miss ('tried' < 'of'), the first "
                     "that keeps all ends the sweep (costlier candidates not run)",
        "needles_answered_by_full": f"{len(recs)}/{len(data)}",
        "per_setting": per,
        "paper_setting": _label(ZIPCACHE_CANDIDATES[0]),
        "predictions": preds,
        "data": needles.describe_data(values),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return dict(chosen), evidence


def _answered_by_full(model, tokenizer, data, log) -> list:
    """``(sample, recording)`` for each sample the full cache answers, its context prefilled once and recorded (the
    others' recordings are dropped)."""
    recs = []
    for s in data:
        kvkit.patch(model, "full")
        rec = record_prefill(model, encode(tokenizer, s.prompt[: s.context_end]).to(model.device))
        g = generate(model, tokenizer, s.prompt, s.max_new_tokens, s.context_end, replay=rec)
        ok = s.answer in g.text
        log(f"{s.id} ({s.needles} needle(s), depth {s.depth:.2f}, {g.prompt_tokens} tok): full "
            f"{'ok' if ok else 'MISS ' + repr(g.text.strip()[:20])}")
        if ok:
            recs.append((s, rec))
        else:
            del rec
    return recs


def _first_keeping_all(model, tokenizer, cands, recs, per: dict, preds: dict, log) -> dict | None:
    """The first of ``cands`` that answers every recorded sample, each candidate stopping at its first miss; fills
    ``per`` (per candidate: answered, tried, kept) and ``preds`` (its answers) on the way. None: none kept all."""
    n_full = len(recs)
    for o in cands:
        kvkit.patch(model, "zipcache", **dict(o, calibrated=False))
        hits = []
        for s, rec in recs:
            gc = generate(model, tokenizer, s.prompt, s.max_new_tokens, s.context_end, replay=rec)
            hits.append(int(s.answer in gc.text))
            preds.setdefault(_label(o), {})[s.id] = gc.text.strip()[:40]
            if not hits[-1]:
                break
        kept = len(hits) == n_full and all(hits)
        per[_label(o)] = {"answered": sum(hits), "tried": len(hits), "of": n_full, "kept_all": kept,
                          "bits_per_element_k_plus_v": round(zipcache_bits(o), 2)}
        log(f"zipcache {_label(o)}: {sum(hits)}/{len(hits)} tried of {n_full}{' -> kept all' if kept else ''}")
        if kept:
            return o
    return None


# ---- the command ----------------------------------------------------------------------------------------------
@calibrator("zipcache", command=zipcache_command)
def run(model, tokenizer, args, out, log) -> tuple[dict, dict]:
    return calibrate_zipcache(model, tokenizer, length=args.length, samples=args.samples, seed=args.seed,
                              values=args.values, log=log)
