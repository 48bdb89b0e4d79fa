"""``kvkit eval compare``: eval summaries joined into one policy x budget table with retention against a baseline
run (:func:`kvkit.evals.compare.compare`); ``--matched`` scores every run only on the samples it shares with its
baseline (:func:`kvkit.evals.compare.compare_matched`)."""

from __future__ import annotations

from pathlib import Path

from kvkit.evals.compare import compare, compare_matched


def cmd_compare(args) -> int:
    fn = compare_matched if args.matched else compare
    print(fn(args.dirs, Path(args.out) if args.out else None, baselines=args.baseline))
    return 0
