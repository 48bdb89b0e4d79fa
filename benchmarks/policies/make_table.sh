#!/bin/bash
# Regenerates compare.md / compare.csv (every run scored on the samples it shares with the full run)
# and the short table in README.md.
cd "$(dirname "$0")/../.."
.venv/bin/kvkit eval compare --matched results/ruler/full-4k results/ruler/streaming2048-4k \
  results/ruler/streaming1024-4k results/policies/*-4k results/policies/cake1024-4k-qaware --out results/policies
.venv/bin/python benchmarks/policies/short_table.py
# ShadowKV at 8K (its regime) against full attention's 8K rows, on the samples both have
.venv/bin/kvkit eval compare --matched results/policies/full-8k results/policies/shadowkv-8k --out results/policies/compare-8k
