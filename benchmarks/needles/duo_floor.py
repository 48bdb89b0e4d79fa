"""DuoAttention's noise floor: which heads a calibration cannot rank, and what calibration data says of them .

At sparsity 0.5 the shipped recipe keeps 4-7 heads whose gates are below 2e-4; two calibrations pick different ones,
and the needle sets swing with them. This script measures, on
calibration samples only (:class:`kvkit.calibrate.duo_data.PasskeyData`: the passkey task on the text no evaluation
reads), how much the streaming window changes each KV head's attention output at the end of the first question
(``|o_full - o_window| / |o_full|``, max over the head's query group, mean over ``--samples`` samples: the
quantity of :mod:`duo_heads`). It then lists the heads whose gate is below ``--floor`` in any ``--pattern``, with
that change and each pattern's choice (``R`` kept whole, ``S`` streamed), and which of them a tie-break by the
change would keep: as many as the pattern keeps from its floor.

    python benchmarks/needles/duo_floor.py --pattern shipped --pattern results/calibration/duo-patterns/smollm2-4k-disjoint.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AttentionInterface

from kvkit import models
from kvkit.calibrate.duo_data import DuoCalibration, PasskeyData

sys.path.insert(0, str(Path(__file__).parent))
from duo_heads import CAPTURE, capture_attention, gates  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pattern", action="append", help="shipped or a pattern file; repeatable (default: shipped)")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--floor", type=float, default=1e-3, help="a gate below this is on the noise floor")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--length", type=int, default=4096, help="longest calibration sample (tokens)")
    ap.add_argument("--min-length", type=int, default=3072)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--out", help="write the first --pattern with its floor gates re-ranked by the output change "
                                  "(0.1 x floor x change / the largest change: still below the floor, ties broken)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    AttentionInterface.register("kvkit_capture", capture_attention)
    model, tok = models.load("default")
    cfg = model.config
    H = cfg.num_key_value_heads
    G = cfg.num_attention_heads // H
    data = PasskeyData(tok, DuoCalibration(steps=args.samples, length=args.length, min_length=args.min_length))
    model.config._attn_implementation = "kvkit_capture"
    CAPTURE.update(sink=args.sink, recent=args.recent, on=True)
    dev = torch.zeros(cfg.num_hidden_layers, H)
    with torch.no_grad():
        for i in range(args.samples):
            ids, labels = data.sample(i)
            cut = int(labels[0].int().argmax()) + len(data.questions[0])  # through the first question
            model(ids[:, :cut], use_cache=False)
            dev += torch.stack([CAPTURE[j][1].view(H, G).amax(-1) for j in range(cfg.num_hidden_layers)])
    dev /= args.samples
    pats = {spec: gates(spec, cfg, args.sparsity) for spec in args.pattern or ["shipped"]}
    floor = torch.zeros_like(dev, dtype=torch.bool)
    for alpha, _ in pats.values():
        floor |= alpha < args.floor
    print(f"{args.samples} calibration samples of {args.min_length}-{args.length} tokens; window sink {args.sink} + "
          f"recent {args.recent}; noise floor: gate < {args.floor} in any pattern ({int(floor.sum())} KV heads)")
    order = sorted((tuple(x) for x in floor.nonzero().tolist()), key=lambda lh: -float(dev[lh]))
    for spec, (alpha, ret) in pats.items():
        own = [lh for lh in order if alpha[lh] < args.floor]  # this pattern's floor, by output change
        kept = [lh for lh in own if ret[lh]]
        pick = own[: len(kept)]
        print(f"{spec}: keeps {len(kept)} heads from its floor {sorted(kept)}; a tie-break by the output change would "
              f"keep {sorted(pick)} ({len(set(kept) & set(pick))} in common)")
    if args.out:
        from kvkit.evals.settings import file_sha256
        from kvkit.policies.duo_patterns import model_identity, save_pattern, shipped_pattern

        spec = (args.pattern or ["shipped"])[0]
        alpha = pats[spec][0].clone()
        low = alpha < args.floor
        alpha[low] = 0.1 * args.floor * dev[low] / dev[low].max()
        base = shipped_pattern(cfg) if spec == "shipped" else spec
        save_pattern(args.out, alpha, model_identity(cfg), {
            "method": f"{spec} with the gates below {args.floor} re-ranked by the streaming window's output change on "
                      f"{args.samples} calibration samples of {args.min_length}-{args.length} tokens "
                      "(benchmarks/needles/duo_floor.py)", "base": str(spec), "base_sha256": file_sha256(base)})
        print(f"wrote {args.out}")
    print("floor heads by output change (mean over samples; per pattern: R/S and the gate):")
    for lh in order:
        marks = " ".join(f"{'R' if r[lh] else 'S'} {float(a[lh]):.1e}" for a, r in pats.values())
        print(f"  L{lh[0]} kv{lh[1]} {float(dev[lh]):.3f} | {marks}")


if __name__ == "__main__":
    main()
