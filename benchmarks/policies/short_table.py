"""Rewrites the short table in results/policies/README.md from compare.csv (run by benchmarks/policies/make_table.sh)."""

import csv
import pathlib
import re

root = pathlib.Path(__file__).resolve().parents[2]
here = root / "results" / "policies"
rows = list(csv.DictReader(open(here / "compare.csv", encoding="utf-8")))
lines = ["| policy | options | samples | min/task | average | full (same samples) | retention | KV vs full |",
         "|---|---|---|---|---|---|---|---|"]
for r in rows:
    lines.append(f"| {r['policy']} | {r['options']} | {r['samples']} | {r['min/task']} | {r['average']} | "
                 f"{r['full (same samples)']} | {float(r['retention']):.2f} | {float(r['KV vs full']):.2f} |")
readme = here / "README.md"
text = readme.read_text(encoding="utf-8")
pattern = re.compile(r"\| policy \| options \| samples \| min/task \|.*?\n(?:\|.*\n)+")
if not pattern.search(text):
    raise SystemExit("results/policies/README.md has no '| policy | options | samples | min/task |' table to rewrite")
readme.write_text(pattern.sub("\n".join(lines) + "\n", text, count=1), encoding="utf-8")
print("\n".join(lines))
