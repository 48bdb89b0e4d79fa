#!/bin/bash
# Regenerates the RULER tables and figure from the committed run folders (after benchmarks/policies/run_policy_table.sh):
# results/ruler/policies-smollm2-4k.md/.csv, policies-qwen05-4k.md/.csv, retention.png, and the 8K comparison
# results/ruler/smollm2-8k/compare.md (ShadowKV at 8K against full attention on the samples both have).
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
.venv/bin/python benchmarks/policies/policy_table.py --model default > /dev/null
.venv/bin/python benchmarks/policies/policy_table.py --model qwen05 > /dev/null
.venv/bin/python benchmarks/policies/retention_figure.py
.venv/bin/python -m kvkit.cli eval compare --matched results/ruler/smollm2-8k/full-8k results/ruler/smollm2-8k/shadowkv-8k \
  --out results/ruler/smollm2-8k
