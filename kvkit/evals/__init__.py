"""Evaluation suite: RULER, needle-in-a-haystack, LongBench and ``kvkit bench`` (see the README's "Evaluate" section and results/README.md).

Every command writes under its ``--out`` directory, atomically: ``samples.jsonl`` (one line per
sample), ``summary.json``, ``summary.md`` and ``summary.csv`` (and ``heatmap.png`` for NIAH).
Eval-only dependencies (matplotlib, rapidfuzz, jieba, rouge-score, wonderwords) are imported lazily.
"""
