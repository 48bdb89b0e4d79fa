r"""Needles kept x full, pooled over several needle sets, with a paired bootstrap 95% interval (how far
apart are two settings once both sets count?).

    python benchmarks/needles/pooled_ratio.py --roots results/needles/default-4k-agnostic \
        results/needles/heldout-squad-4k-agnostic-48 --runs duo

Each ROOT is a ``kvkit eval needles`` root whose ``full`` folder is the reference; each RUN a folder under every
root with ``samples.jsonl``. Only the samples that ``full`` and every run scored count, so all runs are compared on
the same needles. Per run: the needles ``full`` answers, the needles the run answers (a needle full misses counts
if the run answers it, as in the tables), their ratio, and the 2.5/97.5 percentiles of the ratio over
``--resamples`` resamplings of the pooled samples (each sample keeps its full/run pair; seed 0).
"""

import argparse
import random
from pathlib import Path

from paired_runs import scores  # the sibling script's reader of a run's samples.jsonl


def pooled_pairs(roots: list[Path], runs: list[str]) -> dict:
    """``{run: [(full's score, run's score), ...]}`` over the samples every run and full scored, root by root."""
    pairs = {r: [] for r in runs}
    for root in roots:
        full = scores(root, "full")
        got = {r: scores(root, r) for r in runs}
        ids = [i for i in full if all(i in got[r] for r in runs)]
        for r in runs:
            pairs[r] += [(full[i], got[r][i]) for i in ids]
    return pairs


def ratio_interval(pairs: list, resamples: int, seed: int = 0) -> tuple[float, float, float]:
    """``(ratio, low, high)``: sum of the run's scores / sum of full's, and its bootstrap 95% interval."""
    ratio = sum(b for _, b in pairs) / sum(a for a, _ in pairs)
    rng = random.Random(seed)
    n, boot = len(pairs), []
    for _ in range(resamples):
        s = [pairs[rng.randrange(n)] for _ in range(n)]
        f = sum(a for a, _ in s)
        if f:
            boot.append(sum(b for _, b in s) / f)
    boot.sort()
    return ratio, boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--roots", nargs="+", required=True, type=Path)
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--resamples", type=int, default=4000)
    args = ap.parse_args(argv)
    pairs = pooled_pairs(args.roots, args.runs)
    print("| run | samples | full answers | run answers | x full | 95% interval |\n|---|---|---|---|---|---|")
    for r in args.runs:
        p = pairs[r]
        ratio, lo, hi = ratio_interval(p, args.resamples)
        print(f"| {r} | {len(p)} | {sum(a for a, _ in p):.0f} | {sum(b for _, b in p):.0f} | {ratio:.3f} | "
              f"{lo:.2f}-{hi:.2f} |")


if __name__ == "__main__":
    main()
