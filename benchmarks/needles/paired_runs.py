r"""Paired comparison of needle runs on the samples full answers: per pair, the needles one keeps and the other loses,
with an exact two-sided sign test (can a needle set tell two settings apart?).

    python benchmarks/needles/paired_runs.py results/needles/default-4k-agnostic \
        duo snapkv-1526-protect-heads-0.2 kvzip-1526-protect-heads-0.2

ROOT is a ``kvkit eval needles`` root; each RUN a folder under it with ``samples.jsonl`` (its ``full`` folder is the
reference). Only the samples full answers and every run scored are compared. Prints, per pair, ``x vs y`` (needles
the first keeps and the second loses, and the reverse) and the sign test's p, then the needles each run loses.
"""

import itertools
import json
import sys
from math import comb
from pathlib import Path


def scores(root: Path, run: str) -> dict:
    with open(root / run / "samples.jsonl", encoding="utf-8") as f:
        return {row["id"]: row["score"] for row in map(json.loads, f)}


def sign_test(x: int, y: int) -> float:
    """Exact two-sided p of ``x`` against ``y`` discordant pairs under p = 1/2."""
    n = x + y
    return min(1.0, 2 * sum(comb(n, k) for k in range(min(x, y) + 1)) / 2 ** n) if n else 1.0


def main(root: str, runs: list[str]) -> None:
    root = Path(root)
    full = scores(root, "full")
    got = {r: scores(root, r) for r in runs}
    ids = [i for i in full if full[i] == 1 and all(i in got[r] for r in runs)]
    print(f"{len(ids)} samples full answers")
    for a, b in itertools.combinations(runs, 2):
        x = sum(got[a][i] > got[b][i] for i in ids)
        y = sum(got[a][i] < got[b][i] for i in ids)
        print(f"{a:14s} vs {b:14s}: {x} vs {y}  p={sign_test(x, y):.3f}")
    for r in runs:
        print(r, "loses", [i.split("/")[1] for i in ids if got[r][i] == 0])


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
